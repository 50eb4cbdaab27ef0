"""The recipe's `target.matmul: bfloat16` (onnxruntime/cpu): where it is refused, and the demo model built
with it, which keeps the quality gate's bounds against the float32 model, records the option in its
manifest and serves the same greedy text as the float32 artifact. The op itself:
tests/test_matmul_bf16_kernel.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import DEMO_MODEL, write_recipe
from cpu_paths import bf16_dot, expected_default
from test_parity import DEMO_PROMPTS, chunked_logits, hf_logits, hf_model

from compiler.build import build, plan
from compiler.recipe import RecipeError
from runtime import LLM, SamplingParams
from runtime.engine import LLMEngine

PASSES = ("  - name: select_attention\n  - name: capture\n  - name: lower_onnx\n  - name: fuse\n"
          "  - name: package\n")
QUALITY = (f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 2048\n"
           "  max_perplexity_increase_pct: 1.0\n  max_kl_divergence: 0.01\n  min_token_agreement: 0.9\n")


def test_the_option_is_refused_where_it_does_not_apply(tmp_path: Path) -> None:
    for kwargs, passes, match in [
        ({"backend": "torch"}, "  - name: capture\n  - name: package\n", "matmul bfloat16 applies to onnxruntime/cpu"),
        ({}, "  - name: capture\n  - name: lower_onnx\n  - name: package\n", "add 'fuse' after lower_onnx"),
    ]:
        recipe = write_recipe(tmp_path, DEMO_MODEL, passes=passes, matmul="bfloat16", **kwargs)
        with pytest.raises(RecipeError, match=match) as e:
            plan(recipe)
        assert "target.matmul" in str(e.value) and str(recipe) in str(e.value)


@pytest.fixture(scope="module")
def bf16_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bf16")
    runtime = ("  kv_block_size: 16\n  num_kv_blocks: 512\n  max_num_seqs: 16\n  max_num_batched_tokens: 512\n"
               "  max_model_len: 1024\n")
    return build(write_recipe(folder, DEMO_MODEL, name="demo-bf16", passes=PASSES, runtime=runtime,
                              extra=QUALITY, matmul="bfloat16"), progress=False, autotune=False)


def test_demo_build_records_the_option_and_passes_the_gate(bf16_demo: Path) -> None:
    manifest = json.loads((bf16_demo / "manifest.json").read_text())
    assert manifest["target"]["matmul"] == "bfloat16" and manifest["target"]["dtype"] == "float32"
    fuse = next(p for p in manifest["passes"] if p["name"] == "fuse")["stats"]
    assert fuse["fusions"]["matmul_bf16"] == 25  # 6 layers x (qkv, o, gate_up, down) + lm_head
    assert fuse["op_types"]["optimize.MatMulBf16"] == 25 and "Gemm" not in fuse["op_types"]
    assert fuse["matmul_bf16"]["weight_bytes_after"] * 2 == pytest.approx(fuse["matmul_bf16"]["weight_bytes_before"],
                                                                           rel=0.01)
    q = manifest["quality"]
    assert q["passed"] and q["metrics"]["kl_divergence"] < 1e-3 and q["metrics"]["token_agreement"] >= 0.9
    assert abs(q["metrics"]["perplexity_increase_pct"]) < 0.5
    assert json.loads((bf16_demo / "runtime.json").read_text())["graph"]["custom_op_domains"] == ["optimize"]


def test_demo_logits_and_greedy_text(bf16_demo: Path, demo_artifact: Path) -> None:
    engine = LLMEngine(bf16_demo)
    ids = engine.tokenizer.encode(DEMO_PROMPTS[7])
    ref = hf_logits(hf_model(DEMO_MODEL), ids)
    got = chunked_logits(engine, ids, [9, 16, 17, 33, len(ids)])
    # bf16 rounding of both operands: far above float32's 1e-3 logits tolerance, far below what moves tokens
    assert 1e-3 < np.abs(got - ref).max() < 0.25
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.95
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    texts = [o.text for o in LLM(bf16_demo).generate(DEMO_PROMPTS[:4], greedy)]
    assert texts == [o.text for o in LLM(demo_artifact).generate(DEMO_PROMPTS[:4], greedy)]


def test_loading_says_in_one_line_how_bf16_products_run_on_this_cpu(bf16_demo: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Without AVX-512 BF16 the products widen bf16 to float32 in registers, which can be slower than float32
    for prompt processing: a warning at load says so (bench/isa.py measures it)."""
    monkeypatch.delenv("OPTIMIZE_CPU_ISA", raising=False)
    monkeypatch.delenv("OPTIMIZE_BF16_DOT", raising=False)
    with caplog.at_level(logging.INFO):
        LLMEngine(bf16_demo)
    lines = [r for r in caplog.records if r.getMessage().startswith("bfloat16 products on")]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    if bf16_dot():
        assert lines[0].levelno == logging.INFO and "vdpbf16ps" in lines[0].getMessage()
    else:
        assert lines[0].levelno == logging.WARNING
        assert f"on the {expected_default()} path (this CPU has no AVX-512 BF16)" in lines[0].getMessage()
        assert "prompt processing can be slower than float32" in lines[0].getMessage()
