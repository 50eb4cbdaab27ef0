"""TensorRT lowering helpers for the build_engine pass (compiler/passes/build_engine.py).

- `onnx_support`: which (op, element type) pairs TensorRT's ONNX parser reads, a check of a lowered
  graph against that table, and the small rewrites ("legalization") that turn the few patterns our
  exporter emits and TensorRT does not read into equivalent supported ops.
- `profiles`: the optimization profiles of an engine (the ranges of every dynamic input dimension),
  derived from the recipe's serving limits and the CUDA-graph decode buckets.

Nothing here imports tensorrt: everything runs and is tested on a CPU machine.
"""

from __future__ import annotations

from compiler.trt.onnx_support import has_qdq, legalize, unsupported_nodes
from compiler.trt.profiles import EngineLimits, ProfileSpec, engine_profiles

__all__ = ["EngineLimits", "ProfileSpec", "engine_profiles", "has_qdq", "legalize", "unsupported_nodes"]
