"""PyTorch backend: runs an artifact's captured program (model.pt2, torch.export) on one ForwardBatch.

Same contract as the ONNX Runtime backend: the program takes the ForwardBatch arrays plus the
per-layer KV pools [num_blocks, block_size, kv_heads, head_dim] and returns logits plus each
layer's new K/V, which this backend writes into its pools at `slot_mapping` after the call
(`index_copy_` on the pool viewed as slots). On CPU the numpy arrays become tensors without copies.
torch is imported only when such an artifact is loaded: the runtime itself does not need it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.backends import read_geometry
from runtime.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


class TorchBackend:
    """ForwardBatch -> logits with the torch.export program of the artifact (device: cpu)."""

    def __init__(self, model_path: Path, config: dict[str, Any], num_blocks: int | None = None,
                 device: str = "cpu", threads: int | None = None) -> None:
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError("this artifact's backend is torch, which is not installed: "
                               "pip install 'optimize[compiler]' (or torch)") from e
        if device != "cpu":
            raise RuntimeError(f"the torch backend runs device 'cpu' in this version; the artifact asks for "
                               f"{device!r} (the CUDA path with CUDA graphs is not built yet)")
        self._torch = torch
        threads = threads or int(os.environ.get("OPTIMIZE_TORCH_THREADS", "0"))
        if threads:
            torch.set_num_threads(threads)
        dtype = read_geometry(self, config, num_blocks)
        if dtype != "float32":
            raise RuntimeError(f"KV cache dtype {dtype!r} is not supported by the torch backend (float32 only)")
        self.kv_dtype = np.float32
        # Export traces with sizes >= 2 and guards the dynamic dims to that range (size 0/1
        # specialisation); the graph is the same for one sequence or one token, which the parity
        # tests check against transformers, so the guards are not installed.
        self.program = torch.export.load(str(model_path)).module(check_guards=False)
        shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        # numpy views of the torch pools: copy_blocks, tests and metrics see the same memory
        self._k = [torch.zeros(shape, dtype=torch.float32) for _ in range(self.num_layers)]
        self._v = [torch.zeros(shape, dtype=torch.float32) for _ in range(self.num_layers)]
        self.k_pools = [t.numpy() for t in self._k]
        self.v_pools = [t.numpy() for t in self._v]
        self._kv_args: list[Any] = []
        for k, v in zip(self._k, self._v, strict=True):
            self._kv_args += [k, v]
        slots = self.num_blocks * self.block_size
        self._k_slots = [t.view(slots, self.kv_heads, self.head_dim) for t in self._k]
        self._v_slots = [t.view(slots, self.kv_heads, self.head_dim) for t in self._v]
        log.info("torch.export program on cpu, KV pool %s x %d layers", shape, self.num_layers)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * sum(p.nbytes for p in self.k_pools)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in every layer's pools, pair after pair (copy-on-write)."""
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"copy_blocks: block pair ({src}, {dst}) outside the pool of {self.num_blocks}")
        for src, dst in pairs:
            for pool in self._k + self._v:
                pool[dst].copy_(pool[src])

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run one step: returns logits [len(logits_index), vocab] float32 and writes the step's K/V."""
        torch = self._torch
        past_blocks = max(1, -(-int(batch.past_lens.max(initial=0)) // self.block_size))
        args = [torch.from_numpy(a) for a in (
            batch.input_ids, batch.positions, batch.cu_seqlens, batch.past_lens,
            np.ascontiguousarray(batch.block_table[:, :past_blocks]), batch.logits_index)]
        slots = torch.from_numpy(batch.slot_mapping)
        if batch.num_tokens and (int(slots.min()) < 0 or int(slots.max()) >= self.num_blocks * self.block_size):
            raise ValueError("ForwardBatch.slot_mapping out of the KV pool's range")
        with torch.no_grad():
            outs = self.program(*args, *self._kv_args)
            for i in range(self.num_layers):
                self._k_slots[i].index_copy_(0, slots, outs[1 + 2 * i])
                self._v_slots[i].index_copy_(0, slots, outs[2 + 2 * i])
        return outs[0].numpy()
