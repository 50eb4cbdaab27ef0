"""onnxruntime/cuda on a GPU: the demo with PagedAttention over device pools (I/O binding, in-place
cache writes), greedy tokens against the CPU demo artifact, CUDA graphs per decode bucket: the demo's
plan is capturable (every node on the CUDA provider), so a backend that fell back to eager steps
(ONNX Runtime refused the graphs) fails the test. Skips with the reason where onnxruntime-gpu or a
GPU is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compiler.build import build
from runtime.engine import LLM
from runtime.evaluate import prefix_agreement
from runtime.gpu import missing_for
from runtime.sampling import SamplingParams

MISSING = missing_for("onnxruntime")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):\n    if", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n    print("]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_attention_artifact_agrees_with_the_cpu_demo(demo_artifact: Path, tmp_path: Path, dtype: str) -> None:
    import yaml

    recipe = ROOT / "recipes" / "demo-onnxruntime-cuda.yaml"
    data = yaml.safe_load(recipe.read_text())
    data["target"]["dtype"] = dtype
    data["source"]["checkpoint"] = str((recipe.parent / data["source"]["checkpoint"]).resolve())
    quality = data["quality"]  # evaluated there on the GPU (ONNX Runtime's CUDA provider)
    quality["eval_data"] = str((recipe.parent / quality["eval_data"]).resolve())
    if dtype == "bfloat16":  # 8 bits of mantissa: the float16 recipe's +0.5 % bound is not its bound
        quality["max_perplexity_increase_pct"] = 2.0
    derived = tmp_path / f"demo-onnxruntime-cuda-{dtype}.yaml"
    derived.write_text(yaml.safe_dump(data, sort_keys=False))
    artifact = build(derived, progress=False, output=tmp_path)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(demo_artifact).generate(PROMPTS, params)]
    llm = LLM(artifact)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    # float16 / bfloat16 vs float32: a late divergence is allowed (bfloat16 keeps 8 bits of mantissa)
    assert prefix_agreement(want, got) >= (0.9 if dtype == "float16" else 0.75), (want, got)
    plan = json.loads((artifact / "manifest.json").read_text())["cuda_graphs"]
    assert plan["capturable"] and plan["decode_buckets"], plan
    backend = llm.engine.backend
    assert backend.graph_mode == "cuda", "ONNX Runtime refused CUDA graphs for a capturable plan (see the log)"
    assert backend.graph_replays > 0
