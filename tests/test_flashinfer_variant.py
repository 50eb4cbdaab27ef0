"""The `flashinfer` attention variant of the torch targets on a machine without a GPU or FlashInfer.

What runs here: when the variant is valid and when the rule table takes it; a forced build (the program calls
optimize::paged_attention_flashinfer, whose CPU kernel is the reference); and the host side the GPU path
depends on (FlashInfer's page lists per step, which wrapper each step plans, the log-sum-exp merge of the
past and the step's own keys, decode buckets with padding rows) through runtime/kernels/flashinfer_attention.py
with tests/flashinfer_emulation.py standing in for FlashInfer's kernels, against the reference attention,
both per op (hypothesis) and inside the torch backend's engine loop. FlashInfer itself runs in tests/gpu/.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import flashinfer_emulation
import numpy as np
import pytest
import torch
from conftest import make_random_checkpoint, write_recipe
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parity import prompts_of, staggered_greedy

from compiler.attention import KERNELS, candidates
from compiler.build import build
from runtime.backends.torch_ops import paged_attention_flashinfer_op
from runtime.engine import LLMEngine
from runtime.kernels import flashinfer_attention
from runtime.kernels.flashinfer_attention import FlashInferAttention, merge_states, page_metadata
from runtime.kernels.paged_attention import paged_attention_reference

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _cfg(**kw: object) -> SimpleNamespace:
    base = dict(num_heads=8, num_kv_heads=2, head_dim=64, sliding_windows=[None, None])
    return SimpleNamespace(**{**base, **kw})


def test_the_variant_is_valid_for_half_precision_torch_cuda_with_flashinfers_head_dims() -> None:
    def fi(cfg: SimpleNamespace, backend: str = "torch", device: str = "cuda", dtype: str = "float16"):  # noqa: ANN202
        return next(c for c in candidates(cfg, backend, device, dtype) if c.variant == "flashinfer")

    for dtype in ("float16", "bfloat16"):
        for d in (64, 128, 256):
            assert fi(_cfg(head_dim=d), dtype=dtype).valid
    assert "float16/bfloat16, not float32" in fi(_cfg(), dtype="float32").reason
    assert "head_dim 64, 128, 256, not 32" in fi(_cfg(head_dim=32)).reason  # the demo model
    assert "sliding-window" in fi(_cfg(sliding_windows=[4096, None])).reason
    assert "torch targets only" in fi(_cfg(), backend="onnxruntime").reason
    assert "torch targets only" in fi(_cfg(), backend="tensorrt").reason
    assert "CUDA kernels" in fi(_cfg(), device="cpu").reason
    assert not fi(_cfg(num_kv_heads=3)).valid  # heads not a multiple of KV heads
    assert KERNELS["flashinfer"]["implementation"] == "optimize::paged_attention_flashinfer"


def test_page_metadata_is_flashinfers_paged_layout() -> None:
    table = np.array([[7, 3, -1], [2, -1, -1], [4, 9, 1], [5, 6, 8], [0, -1, -1]], dtype=np.int32)
    meta = page_metadata(np.array([0, 1, 3, 4, 9, 10]), np.array([0, 5, 16, 17, 1]), table, 16)
    assert meta["kv_indptr"].tolist() == [0, 0, 1, 2, 4, 5]
    assert meta["kv_indices"].tolist() == [2, 4, 5, 6, 0]
    assert meta["last_page_len"].tolist() == [0, 5, 16, 1, 1]
    assert meta["qo_indptr"].tolist() == [0, 1, 3, 4, 9, 10]
    assert all(a.dtype == np.int32 for a in meta.values())
    padded = page_metadata(np.arange(4), np.array([3, 0, 0]), np.array([[1, -1], [-1, -1], [-1, -1]]), 4,
                           pad_from=1, pad_block=11)
    assert padded["kv_indptr"].tolist() == [0, 1, 2, 3] and padded["kv_indices"].tolist() == [1, 11, 11]
    assert padded["last_page_len"].tolist() == [3, 1, 1]
    with pytest.raises(ValueError, match="names no block"):
        page_metadata(np.array([0, 1]), np.array([20]), np.array([[3, -1]]), 16)
    with pytest.raises(ValueError, match="needs 3 blocks; the block table has 2"):
        page_metadata(np.array([0, 1]), np.array([40]), np.array([[3, 4]]), 16)


def test_merge_with_an_empty_past_is_the_new_segment_even_when_its_output_is_nan() -> None:
    o_b = torch.randn(3, 4, 8)
    s_b = torch.randn(3, 4)
    o_a = torch.full_like(o_b, float("nan"))
    out = merge_states(o_a, torch.full((3, 4), float("-inf")), o_b, s_b)
    assert torch.equal(out, o_b)
    # equal lse: the mean; a segment 1 (base 2) larger weighs twice the other
    out = merge_states(torch.zeros(1, 1, 2), torch.tensor([[1.0]]), torch.ones(1, 1, 2), torch.tensor([[0.0]]))
    assert torch.allclose(out, torch.full((1, 1, 2), 1 / 3))


@st.composite
def steps(draw: st.DrawFn) -> dict:
    kvh = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    mode = draw(st.sampled_from(["mixed", "prefill", "decode", "bucket"]))
    n = draw(st.integers(1, 5))
    if mode in ("decode", "bucket"):
        new = [1] * n
    else:
        new = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n).filter(lambda xs: any(x > 1 for x in xs)))
    past = [0] * n if mode == "prefill" else draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    return {
        "kvh": kvh, "h": kvh * group, "d": draw(st.sampled_from([64, 128])), "mode": mode, "new": new, "past": past,
        "bs": draw(st.sampled_from([1, 4, 16])), "pad": draw(st.integers(1, 3)) if mode == "bucket" else 0,
        "dtype": draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        "scale": draw(st.sampled_from([None, 0.7])), "seed": draw(st.integers(0, 2**16)),
    }


def run_step(c: dict, flashinfer: object = flashinfer_emulation, device: str = "cpu") -> tuple[float, object]:
    """One step of case `c` through FlashInferAttention (planned as the torch backend plans it) against the
    reference; returns the largest error relative to the output's scale, and the planner."""
    g = torch.Generator().manual_seed(c["seed"])
    h, kvh, d, bs, dt = c["h"], c["kvh"], c["d"], c["bs"], c["dtype"]
    new, past = list(c["new"]), list(c["past"])
    n_real = len(new)
    pad_from = None
    if c["mode"] == "bucket":  # padding rows as stage_padded_decode writes them: no past, the spare block first
        new += [1] * c["pad"]
        past += [0] * c["pad"]
        pad_from = n_real
    pages = [-(-p // bs) for p in past]
    width = max(1, max(pages))
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()  # blocks out of order
    table = np.full((len(new), width), -1, dtype=np.int32)
    for i, k in enumerate(pages):
        table[i, :k] = [order.pop() for _ in range(k)]
    if pad_from is not None:
        table[pad_from:, 0] = num_blocks
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    t = int(cu[-1])

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt).to(device)

    q, k, v = rand(t, h * d), rand(t, kvh * d), rand(t, kvh * d)
    k_cache, v_cache = rand(num_blocks + 1, bs, kvh, d), rand(num_blocks + 1, bs, kvh, d)
    scale = (c["scale"] or 1.0) / d ** 0.5
    bucket = len(new) if c["mode"] == "bucket" else None
    fi = FlashInferAttention(h, kvh, d, bs, dt, device, buckets=[bucket] if bucket else (), width=width,
                             flashinfer=flashinfer)
    fi.plan(cu, np.array(past), table, bucket=bucket, pad_from=pad_from, pad_block=num_blocks)
    got = fi.attend(q, k, v, k_cache, v_cache, scale)
    ten = {"cu": torch.from_numpy(cu), "past": torch.tensor(past, dtype=torch.int32), "bt": torch.from_numpy(table)}
    want = paged_attention_reference(q.cpu(), k.cpu(), v.cpu(), k_cache.cpu(), v_cache.cpu(), ten["cu"], ten["past"],
                                     ten["bt"], h, kvh, 0, scale)
    rows = int(cu[n_real])
    err = (got.cpu()[:rows].float() - want[:rows].float()).abs().max().item() if rows else 0.0
    return err / max(1.0, want[:rows].float().abs().max().item() if rows else 1.0), fi


@settings(max_examples=60, deadline=None, derandomize=True)
@given(steps())
def test_planned_steps_equal_the_reference(c: dict) -> None:
    """Mixed steps (past + new tokens, some sequences with no new token), prefills with no past, decode steps
    and decode buckets with padding rows; MHA/GQA/MQA, block sizes 1/4/16, float32/float16/bfloat16, a
    non-default scale: FlashInfer's plan + merge (emulated kernels) equals the reference attention."""
    err, fi = run_step(c)
    assert err <= TOL[c["dtype"]], (err, c)
    planned = {"paged": fi.paged.plans, "ragged": fi.ragged.plans, "decode": fi.decode.plans,
               "bucket": sum(w.plans for w in fi.bucket_decode.values())}
    expect = {"mixed": {"ragged": 1, "paged": int(any(c["past"]))}, "prefill": {"ragged": 1},
              "decode": {"decode": 1}, "bucket": {"bucket": 1}}[c["mode"]]
    assert planned == {**{"paged": 0, "ragged": 0, "decode": 0, "bucket": 0}, **expect}, (planned, c)
    assert fi.mode == ("decode" if c["mode"] in ("decode", "bucket") else "mixed" if expect.get("paged") else "prefill")


def test_the_merge_is_what_makes_it_right() -> None:
    """The check above can fail: without the past segment (or with the lse taken as natural log) a mixed step
    is wrong."""
    c = {"kvh": 2, "h": 8, "d": 64, "mode": "mixed", "new": [3, 1], "past": [20, 7], "bs": 4, "pad": 0,
         "dtype": torch.float32, "scale": None, "seed": 1}
    assert run_step(c)[0] < 1e-5
    original = flashinfer_attention.merge_states
    try:
        flashinfer_attention.merge_states = lambda o_a, s_a, o_b, s_b: original(o_a, s_a * 0.6931, o_b, s_b * 0.6931)
        assert run_step(c)[0] > 1e-2
    finally:
        flashinfer_attention.merge_states = original


def test_a_plan_for_another_step_is_refused() -> None:
    fi = FlashInferAttention(4, 2, 64, 16, torch.float16, "cpu", flashinfer=flashinfer_emulation)
    fi.plan(np.array([0, 3]), np.array([0]), np.full((1, 1), -1), None)
    x = torch.zeros(5, 4 * 64, dtype=torch.float16)
    kv = torch.zeros(5, 2 * 64, dtype=torch.float16)
    pool = torch.zeros(2, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="plan is for a step of 3 tokens; the op got 5"):
        fi.attend(x, kv, kv, pool, pool, 0.125)


@pytest.fixture(scope="module")
def flashinfer_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("torch-cuda-flashinfer")
    ckpt = make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=11, head_dim=64)
    passes = ("  - name: select_attention\n    options:\n      kernel: flashinfer\n  - name: capture\n"
              "  - name: plan_cuda_graphs\n  - name: package\n")
    recipe = write_recipe(folder, ckpt, passes=passes, backend="torch", device="cuda", dtype="float16")
    return build(recipe, progress=False)


def test_a_forced_flashinfer_build_calls_the_op_in_every_layer(flashinfer_artifact: Path) -> None:
    manifest = json.loads((flashinfer_artifact / "manifest.json").read_text())
    assert manifest["kernels"]["attention"] == {**KERNELS["flashinfer"], "variant": "flashinfer",
                                                "selected_by": "forced"}
    assert manifest["cuda_graphs"]["capturable"] and manifest["cuda_graphs"]["decode_buckets"] == [1, 2, 4, 8]
    assert json.loads((flashinfer_artifact / "runtime.json").read_text())["model"]["num_heads"] == 4
    program = torch.export.load(str(flashinfer_artifact / "model.pt2"))
    calls = [n for n in program.graph.nodes if "paged_attention_flashinfer" in str(n.target)]
    assert len(calls) == 2


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here: the rule table takes it (tests/gpu)")
def test_the_rule_table_skips_flashinfer_where_it_is_not_installed(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=11, head_dim=64)
    recipe = write_recipe(tmp_path, ckpt, passes="  - name: select_attention\n  - name: capture\n  - name: package\n",
                          backend="torch", device="cuda", dtype="float16")
    manifest = json.loads((build(recipe, progress=False) / "manifest.json").read_text())
    select = next(p["stats"] for p in manifest["passes"] if p["name"] == "select_attention")
    assert select["choice"] == "triton"
    assert select["rule"] == ("torch/cuda: first valid of flashinfer, triton, decomposed; flashinfer skipped: its "
                              "package (flashinfer) is not installed here")
    assert {c["variant"]: c["valid"] for c in select["candidates"]}["flashinfer"] is True


_emulate = {"on": False}


@paged_attention_flashinfer_op.register_kernel("cpu")
def _cpu(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, head_dim,  # noqa: ANN001, ANN202
         block_size, window, scale):
    """While a test sets _emulate["on"]: the op's CUDA path (the active plan) on CPU; otherwise the reference."""
    if _emulate["on"]:
        return flashinfer_attention.active().attend(q, k, v, k_cache, v_cache, scale)
    return paged_attention_reference(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads,
                                     kv_heads, window, scale)


def test_the_backend_plans_every_step_of_the_engine_loop(flashinfer_artifact: Path) -> None:
    """The torch backend's plan calls (eager steps, padded decode buckets) with the engine's real scheduling
    (staggered arrivals: prefills next to decodes, decode batches of 1..5 padded to buckets): with the
    planned path standing in for the op, the same greedy tokens as the reference op."""
    prompts = prompts_of([5, 17, 33, 9, 12], seed=3)
    arrivals = [0, 0, 2, 5, 6]
    want = staggered_greedy(LLMEngine(flashinfer_artifact, device="cpu", graphs="off"), prompts, arrivals, 10)
    engine = LLMEngine(flashinfer_artifact, device="cpu", graphs="padded")
    backend = engine.backend
    fi = FlashInferAttention(4, 2, 64, backend.block_size, torch.float16, "cpu", flashinfer=flashinfer_emulation)
    backend._flashinfer = fi
    _emulate["on"] = True
    try:
        got = staggered_greedy(engine, prompts, arrivals, 10)
    finally:
        _emulate["on"] = False
        flashinfer_attention._active = None
    assert got == want
    assert backend.bucket_steps > 10 and fi.decode.plans >= backend.bucket_steps
    assert fi.ragged.plans > 0 and fi.paged.plans > 0  # prefills alone, and prefills batched with decodes
