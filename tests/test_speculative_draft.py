"""Speculative decoding with a draft model (runtime/draft.py): greedy output identical to plain decoding
(mixed batches, chunked prefill, prefix caching, preemption), sampled output distributed as plain sampling
(chi-square on a small-vocabulary model), the tokenizer check at load, and the recipe's `speculative:`
section through build, manifest, `optimize inspect` and the runtime finding the paired draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import DEMO_MODEL, write_recipe
from test_parity import DEMO_PROMPTS
from test_recipe import REGISTRY, write
from test_speculative import REPETITIVE, assert_exact_under_preemption, assert_sampled_like_plain, run

from compiler.recipe import RecipeError, load_recipe
from runtime.artifact import Artifact, ArtifactError
from runtime.draft import check_pairing, paired_draft
from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams
from runtime.speculative import SpeculativeConfig

DRAFT = SpeculativeConfig("draft", num_tokens=4)
NGRAM = SpeculativeConfig("ngram", num_tokens=4)


@pytest.fixture(scope="module")
def demo_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint's first 2 of 6 layers (a truncated-layer copy), built as the demo is."""
    from compiler.build import build
    from compiler.draft import truncate_checkpoint

    folder = tmp_path_factory.mktemp("demo-draft")
    ckpt = truncate_checkpoint(DEMO_MODEL, folder / "ckpt", 2)
    passes = "  - name: capture\n  - name: lower_onnx\n    options:\n      opset: 21\n  - name: fuse\n  - name: package\n"
    runtime = ("  kv_block_size: 16\n  num_kv_blocks: 512\n  max_num_seqs: 16\n  max_num_batched_tokens: 512\n"
               "  max_model_len: 1024\n")
    return build(write_recipe(folder, ckpt, name="demo-draft", passes=passes, runtime=runtime), progress=False,
                 autotune=False)


# ---- greedy: identical tokens ------------------------------------------------------------------


def test_greedy_identical_to_plain_mixed_batch(demo_artifact: Path, demo_draft: Path) -> None:
    """The demo prompts plus a repetitive one twice, in one batch: draft, n-gram and plain requests together,
    chunked prefill (32-token budget), prefix caching on: the same tokens as plain greedy decoding."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [*DEMO_PROMPTS, REPETITIVE, REPETITIVE]
    plain = LLMEngine(demo_artifact, max_num_batched_tokens=32, max_num_seqs=8)
    mixed = LLMEngine(demo_artifact, max_num_batched_tokens=32, max_num_seqs=8, draft=demo_draft)
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, params)
        mixed.add_request(f"r{i}", p, params, speculative=(DRAFT, NGRAM, None)[i % 3])
    want, got = run(plain), run(mixed)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}  # type: ignore[attr-defined]
    by = mixed.stats["spec_by_method"]
    assert by["draft"]["proposed"] > 50 and by["draft"]["accepted"] > 5, by
    assert by["ngram"]["proposed"] > 0, by
    assert mixed.stats["generation_tokens"] == plain.stats["generation_tokens"]
    assert mixed.scheduler.prefix_cache_stats().hits > 0
    assert mixed.scheduler.num_free_blocks == mixed.scheduler_config.num_blocks
    assert mixed.draft_model is not None and not mixed.draft_model._seqs  # finished sequences forgotten


def test_greedy_draft_under_preemption(demo_artifact: Path, demo_draft: Path) -> None:
    """A pool of 24 blocks for 8 sequences: preemptions drop sequences' blocks (and the draft's K/V in them);
    the tokens stay those of plain decoding and every block comes back."""
    assert_exact_under_preemption(demo_artifact, speculative=DRAFT, draft=demo_draft)


def test_draft_proposals_are_the_draft_models_greedy_tokens(demo_draft: Path, demo_artifact: Path) -> None:
    """The proposer's K/V bookkeeping: proposals equal the draft artifact's own greedy continuation, also
    after part of a proposal was rejected (the rejected position is recomputed)."""
    alone = LLMEngine(demo_draft)
    alone.add_request("a", REPETITIVE, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ref = run(alone)["a"].token_ids  # type: ignore[attr-defined]
    engine = LLMEngine(demo_artifact, draft=demo_draft)
    dm = engine.draft_model
    assert dm is not None
    toks = engine.tokenizer.encode(REPETITIVE)
    table = list(range(40, 50))
    assert dm.propose([(7, toks, table[: -(-(len(toks) - 1) // 16)], 4)]) == {7: ref[:4]}
    wrong = (ref[2] + 1) % 4096  # the third proposal "rejected": another token there
    toks2 = toks + ref[:2] + [wrong]
    alone.add_request("b", toks2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    want = run(alone)["b"].token_ids  # type: ignore[attr-defined]
    assert dm.propose([(7, toks2, table[: -(-(len(toks2) - 1) // 16)], 4)]) == {7: want}


# ---- sampling: the target distribution ---------------------------------------------------------


def test_sampled_draft_speculation_matches_plain_sampling(tiny_vocab_artifact: Path) -> None:
    """Seeded requests, plain and with the paired 1-layer draft: per output position the token counts pass a
    chi-square test of homogeneity; proposals are both accepted and rejected."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 26, 21, 18, 18, 18, 21, 8, 23, 18, 21, 8, 23, 18, 21, 21, 21, 21, 21, 23, 18]
    assert_sampled_like_plain(tiny_vocab_artifact, prompt, SpeculativeConfig("draft", num_tokens=3),
                              temperature=0.5, min_accepted=600 // 6)


# ---- pairing: the tokenizer check, the recipe section, the manifest and inspect ----------------


def test_tokenizer_and_vocabulary_mismatch_fail_at_load(demo_artifact: Path, demo_draft: Path,
                                                        tiny_vocab_artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="model.vocab_size is 32, the target's 4096"):
        LLMEngine(demo_artifact, draft=paired_draft(Artifact.open(tiny_vocab_artifact)))
    other = tmp_path / "other"
    shutil.copytree(demo_draft, other)
    path = other / "tokenizer" / "tokenizer.json"
    tok = json.loads(path.read_text("utf-8"))
    vocab = tok["model"]["vocab"]
    first = next(t for t in vocab if vocab[t] == 100)
    vocab["zz-renamed"] = vocab.pop(first)
    path.write_text(json.dumps(tok), "utf-8")
    with pytest.raises(ArtifactError, match="does not share the tokenizer") as info:
        check_pairing(Artifact.open(demo_artifact), Artifact.open(other, verify=False))
    assert "zz-renamed" in str(info.value) and repr(first) in str(info.value)
    with pytest.raises(ArtifactError, match="pairs no draft model"):
        LLMEngine(demo_artifact, speculative=DRAFT)  # the demo's manifest pairs none
    engine = LLMEngine(demo_artifact)
    with pytest.raises(ValueError, match="no draft model"):
        engine.add_request("x", "def f():", speculative=DRAFT)


def test_recipe_pairing_manifest_inspect_and_lookup(tiny_vocab_artifact: Path) -> None:
    from test_cli_artifact import run_cli

    manifest = json.loads((tiny_vocab_artifact / "manifest.json").read_text("utf-8"))
    pair = manifest["speculative"]
    assert pair["num_tokens"] == 3 and pair["draft"]["name"] == "tiny-vocab-draft"
    assert pair["draft"]["path"] == "../../tiny-vocab-draft/1.0.0" and pair["draft"]["num_layers"] == 1
    folder = paired_draft(Artifact.open(tiny_vocab_artifact))
    assert folder == (tiny_vocab_artifact.parent.parent / "tiny-vocab-draft" / "1.0.0").resolve()
    assert "speculative" not in json.loads((folder / "manifest.json").read_text("utf-8"))
    res = run_cli("inspect", tiny_vocab_artifact)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("speculative"))
    assert "tiny-vocab-draft 1.0.0" in line and "1 layers" in line and "k=3" in line, line
    engine = LLMEngine(tiny_vocab_artifact, speculative=SpeculativeConfig("draft", 3))  # finds the pair
    assert engine.draft_model is not None and engine.draft_model.artifact.name == "tiny-vocab-draft"
    moved = Artifact(root=tiny_vocab_artifact, manifest={**manifest, "speculative": {
        "draft": {**pair["draft"], "manifest_sha256": "0" * 64}}})
    with pytest.raises(ArtifactError, match="was rebuilt or replaced"):
        paired_draft(moved)


@pytest.mark.parametrize(("section", "line", "fld", "fragment"), [
    ("speculative:\n  num_tokens: 4\n", 26, "speculative.draft", "missing required key 'draft'"),
    ("speculative:\n  draft:\n    truncate_layers: 2\n    checkpoint: x\n", 27, "speculative.draft",
     "exactly one of checkpoint, truncate_layers"),
    ("speculative:\n  draft:\n    truncate_layers: 6\n", 28, "speculative.draft.truncate_layers",
     "not below the 6 layers"),
    ("speculative:\n  draft:\n    checkpoint: nowhere\n", 28, "speculative.draft.checkpoint", "not found"),
    ("speculative:\n  num_tokens: 40\n  draft:\n    truncate_layers: 2\n", 27, "speculative.num_tokens", "40"),
    ("speculative:\n  draft:\n    layers: 2\n", 28, "speculative.draft.layers", "unknown key 'layers'"),
])
def test_recipe_section_errors(tmp_path: Path, section: str, line: int, fld: str, fragment: str) -> None:
    path = write(tmp_path, {26: section + "output: out"})
    with pytest.raises(RecipeError) as info:
        load_recipe(path, REGISTRY)
    err = info.value
    assert (err.line, err.field) == (line, fld), str(err)
    assert fragment in err.message, str(err)


def test_recipe_section_parses(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, {26: "speculative:\n  draft:\n    truncate_layers: 2\noutput: out"}), REGISTRY)
    assert recipe.speculative is not None
    assert (recipe.speculative.num_tokens, recipe.speculative.truncate_layers) == (4, 2)
    assert recipe.as_dict()["speculative"] == {"num_tokens": 4, "draft": {"truncate_layers": 2}}
    assert SpeculativeConfig.parse("draft:k=3") == SpeculativeConfig("draft", 3)
