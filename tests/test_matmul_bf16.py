"""The recipe's `target.matmul: bfloat16` (onnxruntime/cpu): where it is refused, and the demo model built
with it, which keeps the quality gate's bounds against the float32 model, records the option in its
manifest and serves the same greedy text as the float32 artifact. The op itself:
tests/test_matmul_bf16_kernel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import DEMO_MODEL, write_recipe
from test_parity import DEMO_PROMPTS, chunked_logits, hf_logits, hf_model

from compiler.build import build, plan
from compiler.recipe import RecipeError
from runtime import LLM, SamplingParams
from runtime.engine import LLMEngine

PASSES = ("  - name: select_attention\n  - name: capture\n  - name: lower_onnx\n  - name: fuse\n"
          "  - name: package\n")
QUALITY = (f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 4096\n"
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
                              extra=QUALITY, matmul="bfloat16"), progress=False)


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
