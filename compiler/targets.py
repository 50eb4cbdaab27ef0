"""The build targets: which (backend, device) pairs this version builds, their dtypes and passes.

A target decides what the artifact holds and which runtime backend serves it:

- onnxruntime/cpu: model.onnx, ONNX Runtime CPU (runtime/backends/onnxruntime.py).
- torch/cpu and torch/cuda: the torch.export program (model.pt2), runtime/backends/pytorch.py; on
  CUDA the runtime moves the program to the GPU at load and captures one CUDA graph per decode
  bucket of the manifest's plan. The program is exported device-neutral, so a CPU machine builds it.
- onnxruntime/cuda: model.onnx in float16 with com.microsoft.PagedAttention (in-place paged
  KV cache), served by runtime/backends/onnxruntime_cuda.py (I/O binding, CUDA graphs). Built on
  any machine; the PagedAttention kernel itself runs only on ONNX Runtime's CUDA provider.
- tensorrt/cuda: model.onnx (standard ops and Q/DQ only) compiled into a TensorRT engine by the
  build_engine pass on the build machine's GPU; runtime/backends/tensorrt.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    backend: str
    device: str
    dtypes: tuple[str, ...]
    passes: tuple[str, ...] | None = None  # allowed passes; None: any (ONNX targets)
    onnx: bool = True  # the artifact is built from the lowered ONNX graph (lower_onnx required)
    needs_gpu_to_build: bool = False


_TORCH_PASSES = ("select_attention", "capture", "quantize_fp8", "quantize_rtn", "quantize_awq", "quantize_gptq",
                 "lower_quant_torch", "plan_cuda_graphs", "package")
TARGETS: dict[tuple[str, str], Target] = {
    ("onnxruntime", "cpu"): Target("onnxruntime", "cpu", ("float32",)),
    ("onnxruntime", "cuda"): Target("onnxruntime", "cuda", ("float16", "bfloat16")),
    ("torch", "cpu"): Target("torch", "cpu", ("float32",), _TORCH_PASSES, onnx=False),
    ("torch", "cuda"): Target("torch", "cuda", ("float32", "float16", "bfloat16"), _TORCH_PASSES, onnx=False),
    ("tensorrt", "cuda"): Target("tensorrt", "cuda", ("float32", "float16", "bfloat16"), needs_gpu_to_build=True),
}


def target_for(backend: str, device: str) -> Target | None:
    return TARGETS.get((backend, device))


def supported() -> str:
    """'onnxruntime/cpu (float32), ...' for error messages."""
    return ", ".join(f"{b}/{d} ({'|'.join(t.dtypes)})" for (b, d), t in TARGETS.items())


__all__ = ["TARGETS", "Target", "supported", "target_for"]
