"""tensorrt/cuda on a GPU: the demo built into TensorRT engines (float16: recipes/demo-tensorrt.yaml with its
quality gate; float32 seeded with the float16 build's timing cache), greedy tokens against the CPU demo
artifact (float32: the same tokens; float16: agreement >= 0.9), step logits and KV pools against ONNX
Runtime, CUDA-graph replays, and the refusal of an engine recorded for another TensorRT version.
Skips with the reason where TensorRT, pycuda, cuda-python or a GPU is missing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compiler.build import build
from runtime.artifact import Artifact
from runtime.backends.tensorrt import TensorRTBackend, engine_record, present_machine
from runtime.engine import LLM
from runtime.evaluate import prefix_agreement
from runtime.forward_batch import ForwardBatch
from runtime.gpu import missing_for
from runtime.sampling import SamplingParams

MISSING = missing_for("tensorrt")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):\n    if", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n    print("]
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _recipe(folder: Path, dtype: str, timing_cache: Path | None = None) -> Path:
    """recipes/demo-tensorrt.yaml with absolute paths and another dtype, without the quality gate."""
    text = (ROOT / "recipes" / "demo-tensorrt.yaml").read_text(encoding="utf-8")
    text = text.replace("../models", str(ROOT / "models")).replace("../artifacts", str(folder / "artifacts"))
    text = text.replace("dtype: float16", f"dtype: {dtype}").replace("name: pycode-llama-6m-tensorrt",
                                                                     f"name: pycode-llama-6m-tensorrt-{dtype}")
    text = text[:text.index("quality:")] + f"output: {folder / 'artifacts'}\n"
    if timing_cache is not None:
        text = text.replace("      # timing_cache:", f"      timing_cache: {timing_cache}\n      # was:")
    path = folder / f"demo-tensorrt-{dtype}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def fp16_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(ROOT / "recipes" / "demo-tensorrt.yaml", progress=False, output=tmp_path_factory.mktemp("trt16"))


@pytest.fixture(scope="module")
def fp32_artifact(tmp_path_factory: pytest.TempPathFactory, fp16_artifact: Path) -> Path:
    folder = tmp_path_factory.mktemp("trt32")
    return build(_recipe(folder, "float32", timing_cache=fp16_artifact / "timing.cache"), progress=False)


def test_float32_engine_gives_the_cpu_demo_tokens(demo_artifact: Path, fp32_artifact: Path) -> None:
    manifest = json.loads((fp32_artifact / "manifest.json").read_text())
    record = engine_record(manifest)
    assert record is not None and {k: record[k] for k in ("tensorrt_version", "gpu", "compute_capability")} == \
        present_machine()
    info = json.loads((fp32_artifact / "build.json").read_text())["build_engine"]
    assert info["timing_cache_bytes_in"] > 0  # seeded from the float16 build's cache
    want = [o.token_ids for o in LLM(demo_artifact).generate(PROMPTS, PARAMS)]
    llm = LLM(fp32_artifact)
    backend = llm.engine.backend
    assert type(backend).__name__ == "TensorRTBackend"
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == want
    assert backend.graph_mode == "cuda" and backend.graph_replays > 0


def test_float16_engine_agrees_with_the_cpu_demo(demo_artifact: Path, fp16_artifact: Path) -> None:
    manifest = json.loads((fp16_artifact / "manifest.json").read_text())
    assert manifest["quality"]["evaluated"] and manifest["quality"]["passed"]
    want = [o.token_ids for o in LLM(demo_artifact).generate(PROMPTS, PARAMS)]
    got = [o.token_ids for o in LLM(fp16_artifact).generate(PROMPTS, PARAMS)]
    assert prefix_agreement(want, got) >= 0.9, (want, got)  # float16 vs float32: a late divergence is allowed


def test_engine_steps_match_onnx_runtime(demo_artifact: Path, fp32_artifact: Path) -> None:
    """Logits and KV pools after a mixed prefill, graph decode steps (padded to a bucket) and decode without
    a graph, against the ONNX Runtime CPU backend on the same steps."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    ref_art, art = Artifact.open(demo_artifact), Artifact.open(fp32_artifact)
    ref = OnnxRuntimeBackend(ref_art.model_path, ref_art.runtime_config)
    for mode in ("auto", "off"):
        be = TensorRTBackend(art.model_path, art.runtime_config, art.manifest, graphs=mode)
        bs = be.block_size
        tables = np.full((3, 8), -1, np.int32)
        tables[0, :2], tables[1, :2], tables[2, :3] = [0, 1], [2, 3], [4, 5, 6]
        for pool in ref.k_pools + ref.v_pools:
            pool[:] = 0
        rng = np.random.default_rng(0)
        lens, past = [17, 5, 40], [0, 0, 0]
        ids = [list(rng.integers(3, 4096, n)) for n in lens]
        for step in range(4):
            pos = np.concatenate([np.arange(p, p + len(x)) for p, x in zip(past, ids, strict=True)]).astype(np.int64)
            seq = np.repeat(np.arange(3), [len(x) for x in ids])
            cu = np.cumsum([0] + [len(x) for x in ids]).astype(np.int32)
            fb = ForwardBatch(input_ids=np.array([t for x in ids for t in x], np.int64), positions=pos,
                              cu_seqlens=cu, past_lens=np.array(past, np.int32), block_table=tables,
                              slot_mapping=tables[seq, pos // bs].astype(np.int64) * bs + pos % bs,
                              logits_index=(cu[1:] - 1).astype(np.int64))
            want, got = ref.forward(fb), be.forward(fb)
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3, err_msg=f"{mode} step {step}")
            for layer in range(be.num_layers):
                np.testing.assert_allclose(be.pool_contents(layer, "key"), ref.k_pools[layer], rtol=1e-3, atol=1e-3)
            past = [p + len(x) for p, x in zip(past, ids, strict=True)]
            ids = [[int(t)] for t in np.argmax(want, axis=-1)]
        assert (be.graph_replays > 0) == (mode == "auto")
        be.close()


def test_an_engine_recorded_for_another_tensorrt_is_refused(fp32_artifact: Path) -> None:
    art = Artifact.open(fp32_artifact)
    manifest = json.loads(json.dumps(art.manifest))
    record = engine_record(manifest)
    assert record is not None
    record["tensorrt_version"] = "9.0.0"
    manifest["engine"] = record
    with pytest.raises(RuntimeError, match=r"engine built with TensorRT 9\.0\.0 for .*; this machine has TensorRT "):
        TensorRTBackend(art.model_path, art.runtime_config, manifest)
