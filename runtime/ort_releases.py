"""What an ONNX Runtime release can run of the artifacts: the features that need a later release than pyproject's
floor (onnxruntime >= 1.20), each with the first release measured to run it and why.

The build refuses such a feature before any work when the installed release is older (a pass's
`check_environment`), and the runtime says the same at load instead of ONNX Runtime's own error. Found by
running the suite on 1.20.1 and then its failing FP8 tests on later releases (FP8 activations: 1.20.1 and
1.24.4 to 1.27.0 fail, 1.28.0 passes; an FP8 KV cache: 1.20.1 to 1.23.2 fail, 1.24.4 passes). Features that the
installed release's registered schemas decide (GroupQueryAttention's `query_seqlens`,
com.microsoft.PagedAttention) are checked against those schemas instead (compiler/attention/schema.py
`missing_input`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    what: str
    first: tuple[int, int]  # the first (major, minor) release that runs it
    why: str  # what an older release does


FP8_ACTIVATIONS_CPU = Feature(
    "FP8 activations on the CPU execution provider", (1, 28),
    "the graph optimizer fuses an FP8 QuantizeLinear/DequantizeLinear pair and the Gemm after it into a "
    "com.microsoft.QGemm whose schema takes no float8 input, so the session is refused (INVALID_GRAPH)")
FP8_KV_CACHE = Feature(
    "an FP8 KV cache", (1, 24),
    "the Python binding cannot hand float8 outputs (the step's new K/V rows) to numpy ('No corresponding "
    "Numpy type for Tensor Type')")
# not refused by the build: plan_cuda_graphs then checks such a graph's buckets by taint analysis only, saying so
CAST21_CPU = Feature(
    "Running a streamed signed-INT4 graph's CUDA-graph buckets on CPU", (1, 23),
    "the CPU execution provider has no kernel for Cast of opset 21")


def release(version: str) -> tuple[int, int]:
    """'1.24.4' -> (1, 24); an unreadable version reads as (0, 0) (too old for every feature)."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def installed() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def missing(feature: Feature, version: str | None = None) -> str | None:
    """None when ONNX Runtime `version` (default: the installed one) runs `feature`; else why not, in one line."""
    version = installed() if version is None else version
    if release(version) >= feature.first:
        return None
    first = ".".join(map(str, feature.first))
    return (f"{feature.what}: needs onnxruntime >= {first}, and this is onnxruntime {version}, where "
            f"{feature.why}; pip install 'onnxruntime>={first}'")
