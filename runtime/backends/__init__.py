"""Backends: one file each (onnxruntime.py, pytorch.py); every one runs a ForwardBatch and owns the KV pools."""

from __future__ import annotations

from typing import Any


def read_geometry(backend: Any, config: dict[str, Any], num_blocks: int | None) -> str:
    """Set the pool and model facts every backend needs from runtime.json; returns the KV dtype name."""
    kv = config["kv_cache"]
    model = config["model"]
    backend.block_size = int(kv["block_size"])
    backend.num_blocks = int(num_blocks if num_blocks is not None else kv["num_blocks"])
    backend.num_layers = int(model["num_layers"])
    backend.kv_heads = int(model["num_kv_heads"])
    backend.head_dim = int(model["head_dim"])
    backend.vocab_size = int(model["vocab_size"])
    return str(kv.get("dtype", "float32"))
