"""onnxruntime/cuda on a GPU: the demo with PagedAttention over device pools (I/O binding, in-place
cache writes), greedy tokens against the CPU demo artifact, CUDA graphs per decode bucket when ONNX
Runtime accepts them. Skips with the reason where onnxruntime-gpu or a GPU is missing."""

from __future__ import annotations

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


def test_paged_attention_artifact_agrees_with_the_cpu_demo(demo_artifact: Path, tmp_path: Path) -> None:
    artifact = build(ROOT / "recipes" / "demo-onnxruntime-cuda.yaml", progress=False, output=tmp_path)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(demo_artifact).generate(PROMPTS, params)]
    llm = LLM(artifact)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert prefix_agreement(want, got) >= 0.9, (want, got)  # float16 vs float32: a late divergence is allowed
    backend = llm.engine.backend
    if backend.graph_mode == "cuda":
        assert backend.graph_replays > 0
