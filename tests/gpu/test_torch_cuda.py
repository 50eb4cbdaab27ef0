"""torch/cuda on a GPU: the artifact moved to the device, one CUDA graph per decode bucket captured at
load and replayed, greedy tokens equal to transformers (float32) and to the eager path. Skips with the
reason where this machine cannot run the target (runtime/gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_random_checkpoint, write_recipe
from test_parity import hf_greedy, hf_model, prompts_of, staggered_greedy

from compiler.build import build
from runtime.engine import LLMEngine
from runtime.gpu import missing_for

MISSING = missing_for("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
PASSES = "  - name: capture\n  - name: plan_cuda_graphs\n  - name: package\n"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("torch-cuda-gpu")
    ckpt = make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=5)
    return build(write_recipe(folder, ckpt, passes=PASSES, backend="torch", device="cuda"), progress=False), ckpt


def test_cuda_graphs_replay_and_match_transformers(artifact: tuple[Path, Path]) -> None:
    path, ckpt = artifact
    prompts = prompts_of([5, 17, 33, 9, 12], seed=3)
    graphs = LLMEngine(path)
    assert graphs.backend.graph_mode == "cuda" and str(graphs.backend.device) == "cuda"
    got = staggered_greedy(graphs, prompts, [0, 0, 2, 5, 6], 16)
    assert graphs.backend.graph_replays > 10
    eager = LLMEngine(path, graphs="off")
    assert staggered_greedy(eager, prompts, [0, 0, 2, 5, 6], 16) == got
    model = hf_model(ckpt)
    assert got == [hf_greedy(model, p, 16) for p in prompts]
