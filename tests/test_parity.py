"""Built artifacts against Hugging Face transformers: logits, greedy generation, continuous batching.

For the demo model and a small random model of each supported architecture (GQA): the runtime's
logits match transformers within 1e-3 (fp32), and greedy generation of 32 tokens is identical to
`generate`, for one prompt and for 8 prompts of different lengths that arrive at different steps,
with block size 16, prompts crossing block boundaries and a prefill chunk smaller than the
longest prompt.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import DEMO_MODEL, DEMO_RECIPE, make_random_checkpoint, write_recipe

from compiler.build import build
from runtime.engine import LLMEngine
from runtime.forward_batch import ForwardBatch
from runtime.sampling import SamplingParams

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GraniteForCausalLM",
         "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
         # mixtures of experts (tests/conftest.py): renormalised top 2 of 4; un-normalised top 2 of 4 with a
         # shared expert and a dense layer; renormalised top 2 of 8 with q/k norms
         "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
# (architecture, config overrides): the eight families, plus Mistral with a sliding window shorter
# than the prompts so the window mask is exercised across chunks and blocks, and Qwen2 with YaRN
# (Qwen2.5's long-context setting: factor 4 over a pretraining length the prompts cross)
YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# Phi-3.5's LongRoPE with Phi-4-mini's partial rotary (half of each head turns), a context of 4x the
# original 512 (attention factor 1.1); the recipes' max_model_len 512 stays within it: the short factors
LONGROPE = {"rope_theta": 10000.0, "rope_type": "longrope", "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 512, "short_factor": [1.0, 1.3, 2.1, 3.7],
            "long_factor": [1.5, 4.0, 9.0, 20.0]}
VARIANTS = [(a, {}) for a in ARCHS] + [("MistralForCausalLM", {"sliding_window": 24}),
                                        ("Qwen2ForCausalLM", {"rope_parameters": YARN}),
                                        ("Phi3ForCausalLM", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 512,
                                                             "max_position_embeddings": 2048, "sliding_window": 40})]
LOGITS_TOL = 1e-3


VARIANT_IDS = ["llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "gemma2", "gemma3", "mixtral", "qwen2-moe",
               "qwen3-moe", "mistral-sliding",
               "qwen2-yarn",
               "phi3-longrope-partial"]
# every architecture on both CPU targets: ONNX Runtime (model.onnx) and torch (the torch.export program)
BACKENDS = ["onnxruntime", "torch"]
# ... and ONNX Runtime with the C paged-attention kernel (select_attention kernel: paged_cpu), fused: the
# rotary_attention rule hands the packed QKV to optimize.RotaryPagedAttention where the layer allows
# (Qwen3's per-head q/k norm sits between the split and the rotation: it keeps optimize.PagedAttention)
TARGETS = ["onnxruntime", "onnxruntime-paged_cpu", "torch"]
PAGED_CPU_PASSES = ("  - name: select_attention\n    options: {kernel: paged_cpu}\n  - name: capture\n"
                    "  - name: lower_onnx\n  - name: fuse\n  - name: package\n")


# Gemma 2's attention soft-capping is in the decomposed path only: the kernel refuses it at build
# (tests/test_model_families.py), so that pair is not a parity case; of the mixtures of experts (whose
# attention is Mistral's / Qwen's), Mixtral stands for the three on the kernel target
CASES = [(v, b) for b in TARGETS for v in range(len(VARIANTS))
         if not (b == "onnxruntime-paged_cpu" and VARIANTS[v][0] in ("Gemma2ForCausalLM", "Qwen2MoeForCausalLM",
                                                                     "Qwen3MoeForCausalLM"))]


@pytest.fixture(scope="module", params=CASES, ids=[f"{VARIANT_IDS[v]}-{b}" for v, b in CASES])
def random_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint folder, built artifact) for one architecture and target backend."""
    index, target = request.param
    arch, overrides = VARIANTS[index]
    folder = tmp_path_factory.mktemp(arch)
    ckpt = make_random_checkpoint(folder / "ckpt", arch, seed=index, **overrides)
    if target == "onnxruntime-paged_cpu":
        recipe = write_recipe(folder, ckpt, name=arch.lower(), passes=PAGED_CPU_PASSES)
    else:
        recipe = write_recipe(folder, ckpt, name=arch.lower(), backend=target)
    artifact = build(recipe, progress=False)
    if target == "onnxruntime-paged_cpu":
        manifest = json.loads((artifact / "manifest.json").read_text())
        assert manifest["kernels"]["attention"]["variant"] == "paged_cpu"
        fuse = next(p for p in manifest["passes"] if p["name"] == "fuse")["stats"]
        layers = json.loads((artifact / "runtime.json").read_text())["model"]["num_layers"]
        # the fused op rotates whole heads after one QKV split: Qwen3's and OLMo 2's q/k norms and Phi's partial rotary
        # (slices and a concat around the rotation) keep optimize.PagedAttention after the graph's RoPE
        kept = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Olmo2ForCausalLM", "Gemma3ForCausalLM") \
            or "partial_rotary_factor" in overrides.get("rope_parameters", {})
        assert fuse["fusions"]["rotary_attention"] == (0 if kept else layers)
    return ckpt, artifact


@pytest.fixture(scope="module", params=BACKENDS)
def demo_any(request: pytest.FixtureRequest, demo_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model built for each CPU target (recipes/demo.yaml and recipes/demo-torch.yaml)."""
    if request.param == "onnxruntime":
        return demo_artifact
    folder = tmp_path_factory.mktemp("demo-torch")
    text = (DEMO_RECIPE.parent / "demo-torch.yaml").read_text(encoding="utf-8")
    text = text.replace("../models/", f"{DEMO_MODEL.parent}/")
    # no quality gate: this module checks the artifact against transformers itself (test_torch_target.py
    # builds the torch target with its gate)
    text = re.sub(r"\nquality:\n(  .*\n)+", "\n", text)
    assert "quality:" not in text
    recipe = folder / "demo-torch.yaml"
    recipe.write_text(text, encoding="utf-8")
    return build(recipe, progress=False, output=folder / "out")


def hf_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    # generate must neither stop at an EOS id nor suppress it (as min_new_tokens would), like the engine's
    # ignore_eos requests it is compared with; eos_token_id=None alone is filled in from the model's own
    # generation config, so that goes too
    cfg = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False,
                                        eos_token_id=None, pad_token_id=2)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=cfg)
    got = out[0, len(ids):].tolist()
    assert len(got) == n, f"transformers generated {len(got)} of {n} tokens"
    return got


def chunked_logits(engine: LLMEngine, ids: list[int], cuts: list[int]) -> np.ndarray:
    """Run `ids` through the backend in chunks ending at `cuts`, logits for every token."""
    backend = engine.backend
    bs = backend.block_size
    blocks = np.array([7, 3, 11, 5, 9, 1, 13, 2, 4, 6], dtype=np.int32)  # deliberately out of order
    assert len(ids) <= len(blocks) * bs
    out = []
    start = 0
    for end in cuts:
        pos = np.arange(start, end, dtype=np.int64)
        nblocks = -(-end // bs)
        fb = ForwardBatch(
            input_ids=np.asarray(ids[start:end], np.int64), positions=pos,
            cu_seqlens=np.array([0, end - start], np.int32), past_lens=np.array([start], np.int32),
            block_table=blocks[None, :nblocks].copy(),
            slot_mapping=blocks.astype(np.int64)[pos // bs] * bs + pos % bs,
            logits_index=np.arange(end - start, dtype=np.int64))
        fb.validate(backend.num_blocks, bs)
        out.append(backend.forward(fb))
        start = end
    return np.concatenate(out)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4096, size=n).tolist() for n in lengths]


def staggered_greedy(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int], n: int) -> list[list[int]]:
    """Submit prompt i at engine step arrivals[i]; run all to completion; tokens per prompt."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    done: dict[str, list[int]] = {}
    step = 0
    max_running = 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        max_running = max(max_running, engine.scheduler.num_running)
        step += 1
        assert step < 10_000
    assert max_running > 1, "requests should have shared steps (continuous batching)"
    assert engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks
    return [done[f"r{i}"] for i in range(len(prompts))]


# -- random models of each architecture ------------------------------------------------------------


def test_random_model_logits_chunked(random_model: tuple[Path, Path]) -> None:
    ckpt, artifact = random_model
    engine = LLMEngine(artifact)
    ids = prompts_of([70], seed=1)[0]
    ref = hf_logits(hf_model(ckpt), ids)
    got = chunked_logits(engine, ids, [13, 40, 41, 70])  # chunks cross block boundaries (16)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < LOGITS_TOL


def test_random_model_greedy_single(random_model: tuple[Path, Path]) -> None:
    ckpt, artifact = random_model
    prompt = prompts_of([37], seed=2)[0]
    want = hf_greedy(hf_model(ckpt), prompt, 32)
    engine = LLMEngine(artifact)
    engine.add_request("a", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got = out.token_ids
    assert got == want


def test_random_model_greedy_continuous_batching(random_model: tuple[Path, Path]) -> None:
    ckpt, artifact = random_model
    lengths = [5, 17, 33, 64, 100, 15, 48, 81]
    prompts = prompts_of(lengths, seed=3)
    model = hf_model(ckpt)
    want = [hf_greedy(model, p, 32) for p in prompts]
    # prefill chunk (token budget 48) smaller than the longest prompt (100)
    engine = LLMEngine(artifact, max_num_batched_tokens=48, max_num_seqs=8)
    got = staggered_greedy(engine, prompts, arrivals=[0, 0, 1, 3, 4, 9, 15, 22], n=32)
    assert got == want


# -- LongRoPE past the original context -------------------------------------------------------------

# A Phi-3 with LongRoPE over an original context of 64 (8 of each: the 16-dimension heads turn whole), built with
# max_model_len 512 (the recipe's) past it: the build takes the long factors (compiler/checkpoint.py), which is
# transformers' rotation for any forward longer than 64 tokens
LONGROPE_PAST = {"rope_theta": 10000.0, "rope_type": "longrope", "partial_rotary_factor": 1.0,
                 "original_max_position_embeddings": 64,
                 "short_factor": [1.0, 1.05, 1.2, 1.5, 1.9, 2.4, 3.0, 3.6],
                 "long_factor": [1.2, 1.6, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}


@pytest.fixture(scope="module", params=TARGETS)
def longrope_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint, artifact) of that Phi-3 on each CPU target (paged_cpu: fused, the kernel turns q/k)."""
    folder = tmp_path_factory.mktemp("phi3-longrope-past")
    ckpt = make_random_checkpoint(folder / "ckpt", "Phi3ForCausalLM", seed=21, rope_parameters=LONGROPE_PAST,
                                  original_max_position_embeddings=64, max_position_embeddings=512)
    if request.param == "onnxruntime-paged_cpu":
        recipe = write_recipe(folder, ckpt, name="phi3", passes=PAGED_CPU_PASSES)
    else:
        recipe = write_recipe(folder, ckpt, name="phi3", backend=request.param)
    artifact = build(recipe, progress=False)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["source"]["config"]["rope_scaling"]["factors"] == "long"
    assert json.loads((artifact / "runtime.json").read_text())["scheduler"]["max_model_len"] == 512
    if request.param == "onnxruntime-paged_cpu":
        fuse = next(p for p in manifest["passes"] if p["name"] == "fuse")["stats"]
        assert fuse["fusions"]["rotary_attention"] == 2  # the kernel rotates with the artifact's caches
    return ckpt, artifact


def test_longrope_logits_past_the_original_context(longrope_model: tuple[Path, Path]) -> None:
    """A 100-token prompt (the original context is 64), prefilled in chunks of which one ends at 64 and the
    next crosses it: every token's logits within 1e-3 of transformers' forward of the whole prompt."""
    ckpt, artifact = longrope_model
    ids = prompts_of([100], seed=5)[0]
    model = hf_model(ckpt)
    ref = hf_logits(model, ids)
    got = chunked_logits(LLMEngine(artifact), ids, [13, 40, 64, 65, 100])
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < LOGITS_TOL
    # transformers switches factor sets per forward, by its length: a 40-token forward (within 64) turns with
    # the short factors. The artifact turns every position with the long ones, so on a prompt within the
    # original context its logits are those of the same tokens at the head of a longer forward
    # (docs/architecture.md, LongRoPE), not transformers' of the short forward
    short = LLMEngine(artifact)
    head = chunked_logits(short, ids[:40], [40])
    assert np.abs(head - ref[:40]).max() < LOGITS_TOL
    assert np.abs(head - hf_logits(model, ids[:40])).max() > 10 * LOGITS_TOL


def test_longrope_greedy_past_the_original_context(longrope_model: tuple[Path, Path]) -> None:
    """Greedy generation through the engine's scheduler from prompts already past the original context
    (transformers turns all of these with the long factors): identical to transformers' `generate`."""
    ckpt, artifact = longrope_model
    prompts = prompts_of([70, 90], seed=6)
    model = hf_model(ckpt)
    want = [hf_greedy(model, p, 24) for p in prompts]
    engine = LLMEngine(artifact, max_num_batched_tokens=48, max_num_seqs=4)
    assert staggered_greedy(engine, prompts, arrivals=[0, 1], n=24) == want


# -- the trained demo model ------------------------------------------------------------------------


DEMO_PROMPTS = [
    "def fibonacci(n):\n    if",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    '"""Utilities for reading files."""\n',
    "for i in range(10):\n",
    "    def __repr__(self):\n        return",
    "try:\n    import _thread\nexcept ImportError:\n    _thread = None\n\n__all__ = [",
    "x = ",
    "class Error(Exception):\n    \"\"\"Base class for errors in this module.\"\"\"\n\n    def __init__(self, msg):\n"
    "        self.msg = msg\n        Exception.__init__(self, msg)\n\n    def __str__(self):\n        return self.msg\n",
]


def test_demo_logits(demo_any: Path) -> None:
    engine = LLMEngine(demo_any)
    ids = engine.tokenizer.encode(DEMO_PROMPTS[7])
    assert 40 < len(ids) <= 160
    ref = hf_logits(hf_model(DEMO_MODEL), ids)
    got = chunked_logits(engine, ids, [9, 16, 17, 33, len(ids)])
    assert np.abs(got - ref).max() < LOGITS_TOL


def test_demo_greedy_single_and_batched(demo_any: Path) -> None:
    model = hf_model(DEMO_MODEL)
    engine = LLMEngine(demo_any, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = [engine.tokenizer.encode(p) for p in DEMO_PROMPTS]
    assert max(len(p) for p in prompts) > 32  # longer than one prefill chunk
    want = [hf_greedy(model, p, 32) for p in prompts]
    single = staggered_greedy_single(engine, prompts[0])
    assert single == want[0]
    got = staggered_greedy(engine, prompts, arrivals=[0, 1, 1, 2, 5, 8, 13, 21], n=32)
    assert got == want


def staggered_greedy_single(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("single", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.finished:
                return out.token_ids


def test_demo_generation_matches_model_card(demo_artifact: Path) -> None:
    """The demo model's README records its greedy continuation of "def fibonacci(n):\\n"."""
    import json

    card = json.loads((DEMO_MODEL / "verify.json").read_text())
    engine = LLMEngine(demo_artifact)
    prompt = engine.tokenizer.encode(card["prompt"])
    assert prompt == card["prompt_ids"]
    want = card["generated_ids"]  # the 64 new tokens
    engine.add_request("card", prompt, SamplingParams(max_tokens=len(want), temperature=0.0, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got = out.token_ids
    assert got == want
    assert engine.tokenizer.decode(got) == card["completion"]


@pytest.mark.slow
def test_demo_eval_perplexity_matches_transformers(demo_artifact: Path) -> None:
    """`optimize eval` on eval.txt (its first 2048 tokens: 8 chunks) equals transformers' perplexity to 4
    significant digits."""
    import json
    import math
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "compiler.cli", "eval", str(demo_artifact), "--data",
         str(DEMO_MODEL / "eval.txt"), "--max-tokens", "2048", "--json"], capture_output=True, text=True, check=True)
    ours = json.loads(proc.stdout)
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    ids = tok((DEMO_MODEL / "eval.txt").read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    n = min(len(ids), 2048) // 256
    chunks = torch.tensor(ids[: n * 256]).view(n, 256)
    model = hf_model(DEMO_MODEL)
    nll, count = 0.0, 0
    with torch.no_grad():
        for batch in chunks.split(16):
            logp = torch.log_softmax(model(batch).logits.double(), -1)
            nll -= float(logp[:, :-1].gather(-1, batch[:, 1:, None]).sum())
            count += batch.shape[0] * 255
    ref = math.exp(nll / count)
    assert ours["predictions"] == count
    assert f"{ours['perplexity']:.4g}" == f"{ref:.4g}", (ours["perplexity"], ref)
