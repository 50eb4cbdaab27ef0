"""The torch target on CPU: what plan() accepts and refuses, and the artifact it writes (parity with
transformers is in test_parity.py, which runs every architecture on both CPU targets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DEMO_MODEL, make_random_checkpoint, write_recipe

from compiler.build import build, plan
from compiler.recipe import RecipeError
from runtime.artifact import verify_artifact
from runtime.engine import LLM
from runtime.sampling import SamplingParams


def test_torch_cpu_artifact_holds_the_program_and_runs(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=11)
    artifact = build(write_recipe(tmp_path, ckpt, backend="torch"), progress=False)
    files = {f["path"] for f in json.loads((artifact / "manifest.json").read_text())["files"]}
    assert "model.pt2" in files and "model.onnx" not in files
    assert json.loads((artifact / "runtime.json").read_text())["model_file"] == "model.pt2"
    assert verify_artifact(artifact) == []
    llm = LLM(artifact)
    assert type(llm.engine.backend).__name__ == "TorchBackend"
    outs = llm.generate(["def f(x):\n    return", "import"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]


@pytest.mark.parametrize("passes,field,words", [
    ("  - name: capture\n  - name: lower_onnx\n  - name: package\n", "passes[1].name",
     ["'lower_onnx' does not apply to the torch target",
      "capture, quantize_fp8, quantize_rtn, quantize_awq, quantize_gptq, lower_quant_torch, plan_cuda_graphs, package"]),
    ("  - name: capture\n  - name: quantize_rtn\n  - name: package\n", "passes[1].name",
     ["'quantize_rtn' needs 'lower_quant_torch' later in the list"]),
])
def test_torch_target_refuses_onnx_and_quantization_passes(tmp_path: Path, passes: str, field: str,
                                                           words: list[str]) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, passes=passes, backend="torch")
    with pytest.raises(RecipeError) as e:
        plan(recipe)
    assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)


def test_onnxruntime_target_needs_lower_onnx(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, passes="  - name: capture\n  - name: package\n")
    with pytest.raises(RecipeError, match="needs 'lower_onnx'"):
        plan(recipe)
