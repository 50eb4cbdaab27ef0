"""Tokenizer parity: the artifact tokenizes as transformers does; unsupported checkpoints name their nearest family.

A Qwen2 checkpoint carrying the demo's byte-level tokenizer.json (GPT-2's split regex, no NFC)
is what transformers 5 rebuilds as Qwen2Tokenizer; the build must ship that pipeline and check it.
Everything is local: random checkpoints from transformers config classes, the demo's tokenizer files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import DEMO_MODEL, ROOT, make_random_checkpoint, write_recipe

from compiler.build import build
from compiler.checkpoint import inspect_checkpoint
from compiler.passes import BuildError
from compiler.tokenizer import (
    PARITY_TEXTS,
    TokenizerParityError,
    check_parity,
    parity_texts,
    resolve_tokenizer,
    write_tokenizer,
)
from runtime.artifact import describe
from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams
from runtime.server import ChatTemplate
from runtime.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = "def f(x):\n\n    return x\n\n\nclass A:\n\n"


def tokenizer_folder(folder: Path, **extra_files: str) -> Path:
    """The demo's tokenizer files (no config.json: transformers uses the file's tokenizer_class)."""
    folder.mkdir(parents=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / f, folder / f)
    for name, text in extra_files.items():
        (folder / name.replace("__", ".")).write_text(text, encoding="utf-8")
    return folder


def test_parity_sample_covers_code_prose_scripts_emoji_whitespace_and_added_tokens() -> None:
    hf = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    texts = parity_texts(hf)
    joined = "".join(texts)
    assert len(texts) == len(PARITY_TEXTS) + 1
    assert all(t in texts[-1] for t in ("<|bos|>", "<|eos|>", "<|pad|>"))  # the added tokens, in a text
    assert 1000 < len(joined) < 8000  # a few KB: fast enough for every build
    for needle in ("def ", "\n\n\n", "\t", "\r\n", "Größe", "Съешь", "中文", "العربية", "👩‍👩‍👧‍👦", "e\u0301"):
        assert needle in joined or needle.replace("e\u0301", "cafe\u0301") in joined, needle


def test_demo_tokenizer_is_used_as_found(tmp_path: Path) -> None:
    resolved = resolve_tokenizer(DEMO_MODEL)
    assert resolved.tokenizer_class == "TokenizersBackend"
    assert resolved.differs_in == () and resolved.config_resolved == ()
    files = tuple(DEMO_MODEL / f for f in TOKENIZER_FILES)
    record = write_tokenizer(DEMO_MODEL, files, tmp_path / "tokenizer")
    assert record["source"] == "file" and record["class"] == "TokenizersBackend"
    assert record["parity"]["texts"] == len(PARITY_TEXTS) + 1 and record["parity"]["tokens"] > 1000
    for f in TOKENIZER_FILES:  # byte for byte: the demo artifact stays what it was
        assert (tmp_path / "tokenizer" / f).read_bytes() == (DEMO_MODEL / f).read_bytes()


def test_parity_check_names_text_position_and_both_ids(tmp_path: Path) -> None:
    """A tokenizer.json that lost the merge of "\\n" + "   " (a deliberately broken pipeline)."""
    data = json.loads((DEMO_MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    data["model"]["merges"] = [m for m in merges if m != ["Ċ", "ĠĠĠ"]]
    assert len(data["model"]["merges"]) == len(merges) - 1
    broken = tokenizer_folder(tmp_path / "broken")
    (broken / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    text = "one\n    two"
    with pytest.raises(TokenizerParityError) as e:
        check_parity(broken, hf, ["plain words", text])
    msg = str(e.value)
    want = hf.encode(text)
    got = Tokenizer(broken).encode(text)
    pos = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    assert f"parity text 1 (add_special_tokens=True) at token {pos} (text offset 3)" in msg
    assert f"transformers {want[pos]} 'ĊĠĠĠ'" in msg and f"runtime {got[pos]} '" in msg
    assert "'one\\n    two'" in msg


def test_chat_template_file_and_special_tokens_travel_in_tokenizer_config(tmp_path: Path) -> None:
    """transformers 5 reads chat_template.jinja; the runtime reads tokenizer_config.json's chat_template."""
    template = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
    src = tokenizer_folder(tmp_path / "src", chat_template__jinja=template)
    files = tuple(src / f for f in (*TOKENIZER_FILES, "chat_template.jinja"))
    record = write_tokenizer(src, files, tmp_path / "tokenizer")
    assert record["source"] == "file" and record["config_resolved"] == ["chat_template"]
    config = json.loads((tmp_path / "tokenizer" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == template
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\n\nthere"}]
    hf = transformers.AutoTokenizer.from_pretrained(src)
    text, _ = ChatTemplate(config).render(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert Tokenizer(tmp_path / "tokenizer").encode(text, add_special_tokens=False) == \
        hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.fixture(scope="module")
def qwen2_byte_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 checkpoint with the demo's byte-level tokenizer.json (no Qwen2 split regex, no NFC) and
    a generation_config.json whose EOS ids differ from config.json's."""
    ckpt = make_random_checkpoint(tmp_path_factory.mktemp("qwen2-bytelevel") / "ckpt", "Qwen2ForCausalLM")
    (ckpt / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 7]}))
    return ckpt


def test_qwen2_checkpoint_with_byte_level_tokenizer_builds_with_transformers_ids(
        qwen2_byte_level: Path, tmp_path: Path) -> None:
    ckpt = qwen2_byte_level
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    raw = Tokenizer(ckpt)  # the file as found, as the runtime read it before
    assert raw.encode(PROMPT) != hf.encode(PROMPT)  # the gap: "\n\n" is one token in transformers

    artifact = build(write_recipe(tmp_path, ckpt), progress=False)
    manifest = json.loads((artifact / "manifest.json").read_text(encoding="utf-8"))
    tok = manifest["tokenizer"]
    assert tok["source"] == "transformers" and tok["class"] == "Qwen2Tokenizer"
    assert {"normalizer", "pre_tokenizer"} <= set(tok["resolved"])
    assert tok["parity"]["texts"] == len(PARITY_TEXTS) + 1 and tok["parity"]["tokens"] > 1000
    package = next(p for p in manifest["passes"] if p["name"] == "package")
    assert package["config"]["tokenizer"] == "transformers" and package["stats"]["tokenizer_source"] == "transformers"
    assert "transformers" in manifest["created_by"] and "tokenizers" in manifest["created_by"]
    assert dict(describe(manifest))["tokenizer"].startswith("resolved by transformers' Qwen2Tokenizer (replaces")

    runtime_tok = Tokenizer(artifact / "tokenizer")
    for text in [PROMPT, *parity_texts(hf)]:
        for special in (True, False):
            assert runtime_tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    # what evaluation harnesses load from the artifact's folder (lm-eval, guidellm) agrees too
    from_artifact = transformers.AutoTokenizer.from_pretrained(artifact / "tokenizer")
    assert from_artifact.encode(PROMPT) == hf.encode(PROMPT)

    # generation_config.json's EOS ids are what the runtime stops on
    runtime_json = json.loads((artifact / "runtime.json").read_text(encoding="utf-8"))
    assert runtime_json["model"]["eos_token_ids"] == [1, 7]
    engine = LLMEngine(artifact)
    assert engine.eos_token_ids == {1, 7}

    # greedy continuation of a text prompt: the runtime's ids are transformers'
    ids = hf.encode(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    cfg = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), generation_config=cfg)[0, len(ids):].tolist()
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got = out.token_ids
    assert got == want


def test_tokenizer_as_found_that_transformers_replaces_fails_the_build(qwen2_byte_level: Path,
                                                                       tmp_path: Path) -> None:
    """`tokenizer: file` ships the checkpoint's tokenizer.json as found: for this checkpoint that is the
    silent mismatch of issue 18, which the parity check turns into a failed build."""
    recipe = write_recipe(tmp_path, qwen2_byte_level, backend="torch",
                          passes="  - name: capture\n  - name: package\n    options: {tokenizer: file}\n")
    with pytest.raises(BuildError) as e:
        build(recipe, progress=False)
    msg = str(e.value)
    assert "transformers' Qwen2Tokenizer give different ids for parity text 0 (add_special_tokens=True) at token" in msg
    assert "runtime " in msg and "transformers " in msg and "text: 'def fibonacci" in msg
    assert not (tmp_path / "artifacts" / "test-model").exists()  # a failed build leaves nothing


def test_generation_config_eos_ids_override_config(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(DEMO_MODEL, folder)
    assert inspect_checkpoint(folder).config.eos_token_ids == (1,)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 3]}))
    assert inspect_checkpoint(folder).config.eos_token_ids == (1, 2, 3)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))  # names none: config's
    assert inspect_checkpoint(folder).config.eos_token_ids == (1,)


def dry_run(tmp_path: Path, config: dict[str, object]) -> subprocess.CompletedProcess[str]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path, ckpt)
    return subprocess.run([sys.executable, "-m", "compiler.cli", "build", "--dry-run", str(recipe)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_names_nearest_family_of_gemma(tmp_path: Path) -> None:
    cfg = transformers.GemmaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    cfg["architectures"] = ["GemmaForCausalLM"]
    res = dry_run(tmp_path, cfg)
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert "architecture 'GemmaForCausalLM' (model_type gemma) is not supported" in out
    assert "nearest supported family: gemma2 (Gemma2ForCausalLM); gemma differs in:" in out
    assert "RMSNorm before each branch only (gemma2: before and after)" in out
    assert "GeGLU" not in out  # what Gemma 2 has too


def test_dry_run_names_nearest_family_of_an_unknown_model_type(tmp_path: Path) -> None:
    """A model type no table knows: the comparison of its config keys picks the family and the differences."""
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    cfg.update(architectures=["AcmeForCausalLM"], model_type="acme", use_qk_norm=True, num_local_experts=4,
               num_experts_per_tok=2, rope_parameters={"rope_type": "su", "rope_theta": 1e6, "factor": 4.0})
    res = dry_run(tmp_path, cfg)
    assert res.returncode == 1
    out = res.stdout + res.stderr
    # q/k norms point at Qwen3; its experts at Qwen3's mixture-of-experts family, where they are no difference
    assert "nearest supported family: qwen3_moe (Qwen3MoeForCausalLM); acme differs in:" in out
    assert "mixture of experts" not in out
    assert "RoPE type 'su'" in out and "q/k LayerNorm" not in out
