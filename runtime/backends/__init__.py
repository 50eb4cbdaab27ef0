"""Backends: one file each (onnxruntime.py, onnxruntime_cuda.py, pytorch.py, tensorrt.py); every one runs a ForwardBatch
and owns the KV pools. `load_backend` picks the artifact's, importing only that one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.forward_batch import ForwardBatch

if TYPE_CHECKING:  # pragma: no cover
    from runtime.artifact import Artifact


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


def decode_bucket(batch: ForwardBatch, buckets: list[int], width: int) -> int | None:
    """The CUDA-graph bucket of a decode step: the smallest bucket >= its sequences when every sequence
    has one token and one logits row and the block table fits the plan's width; None: run eagerly."""
    n = batch.num_seqs
    if not buckets or n == 0 or batch.num_tokens != n or n > buckets[-1] or batch.block_table.shape[1] > width:
        return None
    if not np.array_equal(batch.logits_index, np.arange(n)):
        return None
    return next(b for b in buckets if b >= n)


def stage_padded_decode(host: dict[str, np.ndarray], batch: ForwardBatch, pad_block: int, block_size: int) -> None:
    """Write a decode step of n sequences into a bucket's static host arrays (b rows; cu_seqlens and
    logits_index are fixed at 0..b). Rows n.. are padding: token 0 at position 0, no past, a block-table
    row naming only the spare pool block `pad_block` (never scheduled) and, where there is a slot_mapping,
    that block's first slot: padding K/V land there whether the graph or the backend writes them."""
    n = batch.num_seqs
    for name in ("input_ids", "positions", "past_lens"):
        host[name][:n] = getattr(batch, name)
        host[name][n:] = 0
    table = host["block_table"]
    cols = batch.block_table.shape[1]
    table[:n, :cols] = batch.block_table
    table[:n, cols:] = -1
    table[n:] = -1
    table[n:, 0] = pad_block
    if "slot_mapping" in host:
        host["slot_mapping"][:n] = batch.slot_mapping
        host["slot_mapping"][n:] = pad_block * block_size


def load_backend(artifact: Artifact, num_blocks: int | None, threads: int | None, device: str | None = None,
                  graphs: str | None = None, cpu_isa: str | None = None) -> Any:
    """The artifact's backend on its target device, or on `device` when given (e.g. 'cpu' to run a CUDA
    torch artifact on a machine without a GPU); `graphs` is the torch backend's CUDA-graph mode; `cpu_isa`
    the code path of the package's C ops (ONNX Runtime CPU; None: OPTIMIZE_CPU_ISA, else the CPU's widest)."""
    cfg = artifact.runtime_config
    backend = cfg.get("backend")
    device = device or cfg.get("device", "cpu")
    if backend == "onnxruntime":
        if device == "cuda":
            from runtime.backends.onnxruntime_cuda import OnnxRuntimeCudaBackend

            return OnnxRuntimeCudaBackend(artifact.model_path, cfg, artifact.manifest, num_blocks=num_blocks,
                                          graphs=graphs)
        from runtime.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(artifact.model_path, cfg, num_blocks=num_blocks, intra_op_threads=threads,
                                  cpu_isa=cpu_isa)
    if backend == "torch":
        from runtime.backends.pytorch import TorchBackend

        return TorchBackend(artifact.model_path, cfg, num_blocks=num_blocks, device=device, threads=threads,
                            cuda_graphs=artifact.manifest.get("cuda_graphs"), graphs=graphs,
                            attention=artifact.manifest.get("kernels", {}).get("attention", {}).get("variant"))
    if backend == "tensorrt":
        if device != "cuda":
            raise RuntimeError(f"a TensorRT engine runs on the GPU it was built for, not on {device!r}")
        from runtime.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(artifact.model_path, cfg, artifact.manifest, num_blocks=num_blocks, graphs=graphs)
    raise RuntimeError(f"artifact backend {backend!r} is not available in this runtime "
                       "(have: onnxruntime, torch, tensorrt)")
