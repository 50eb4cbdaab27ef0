"""FlashInfer paged attention for the torch targets on CUDA: one host-side plan per step, kernels per layer.

FlashInfer's wrappers split attention into a plan made on the host once per step (indptr arrays, page
lists, the kernel schedule) and kernels run once per layer. The program's attention op
(optimize::paged_attention_flashinfer, runtime/backends/torch_ops.py) cannot plan: it runs inside the
torch.export program and, for decode buckets, inside a captured CUDA graph. So the torch backend calls
`FlashInferAttention.plan` before each step (before each graph replay) and the op's CUDA kernel calls
`attend` on the plan made last (`active()`).

The ForwardBatch contract keeps each sequence's past in the pools and hands this step's K/V to the op,
which the backend writes into the pools after the program. FlashInfer reads keys from a paged cache or
a ragged tensor, so a step is attention over two segments merged by their log-sum-exp (the identity
FlashInfer's cascade attention uses):

- past: the pools as FlashInfer's paged cache (NHD: [pages, page_size, kv_heads, head_dim], our layout).
  Sequence b has pages block_table[b, :ceil(past/bs)], the last one holding past - (pages - 1) * bs
  entries; every new token sees the whole past (causal=False). No pages and last length 0: empty.
- new: this step's own K/V as a ragged batch with qo_indptr = kv_indptr = cu_seqlens, causal (FlashInfer
  aligns a causal mask to the end of the keys: query i sees keys <= i when lengths are equal).
- merge (`merge_states`): with lse in base 2 (FlashInfer's convention) and m = max(s_p, s_n),
  o = (o_p 2^(s_p - m) + o_n 2^(s_n - m)) / (2^(s_p - m) + 2^(s_n - m)); an empty past has s_p = -inf
  and weight 0, whatever its o holds. The new segment is never empty (a token sees itself).

Decode steps (one new token per sequence; the CUDA-graph buckets) take FlashInfer's decode wrapper for
the past (a wrapper with fixed device buffers per bucket, created with use_cuda_graph=True, which `plan`
refills before each replay), and the new segment is one key per token: o_n = v of its KV head and
s_n = scale q.k log2(e), in torch ops. A prefill with no past in any sequence runs the ragged segment alone.

Scale: plans use FlashInfer's default 1/sqrt(head_dim); an op called with another scale multiplies q
first. Limits (the variant's candidate check, compiler/attention/): float16/bfloat16 pools and queries,
head_dim in FLASHINFER_HEAD_DIMS, no sliding window.

`flashinfer` is imported only when a FlashInferAttention is created; a module with the same wrapper
classes can be passed instead (tests/flashinfer_emulation.py runs this planning and merging on CPU).
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)

_active: FlashInferAttention | None = None


def active() -> FlashInferAttention:
    """The FlashInferAttention that planned last in this process (the step being run)."""
    if _active is None:
        raise RuntimeError("optimize::paged_attention_flashinfer ran on CUDA without a FlashInfer plan: the torch "
                           "backend plans each step (runtime/backends/pytorch.py); load the artifact with LLMEngine")
    return _active


def page_metadata(cu_seqlens: np.ndarray, past_lens: np.ndarray, block_table: np.ndarray, block_size: int,
                  pad_from: int | None = None, pad_block: int = 0) -> dict[str, np.ndarray]:
    """FlashInfer's paged-KV description of each sequence's past: kv_indptr [B+1] (pages), kv_indices (the
    pages, sequence after sequence), last_page_len [B] (0 for no past), all int32, plus qo_indptr [B+1].
    Rows from `pad_from` on are decode-bucket padding: one page, `pad_block`, with one entry (the
    spare block padding rows write to), so a captured decode kernel never sees an empty row."""
    past = np.asarray(past_lens, dtype=np.int64).copy()
    table = np.asarray(block_table)
    if pad_from is not None:
        past[pad_from:] = 1
        table = table.copy()
        table[pad_from:, 0] = pad_block
    pages = -(-past // block_size)
    if len(past) and pages.max(initial=0) > table.shape[1]:
        raise ValueError(f"a sequence's past needs {int(pages.max())} blocks; the block table has {table.shape[1]}")
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    indices = table[used].astype(np.int32)  # row-major: each sequence's pages in order
    if (indices < 0).any():
        raise ValueError("the block table names no block (-1) inside a sequence's past")
    kv_indptr = np.zeros(len(past) + 1, dtype=np.int32)
    kv_indptr[1:] = np.cumsum(pages)
    last = np.where(pages > 0, past - (pages - 1) * block_size, 0).astype(np.int32)
    return {"qo_indptr": np.asarray(cu_seqlens, dtype=np.int32), "kv_indptr": kv_indptr, "kv_indices": indices,
            "last_page_len": last}


def single_key_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Attention of each token over its own key alone: output v (of the query head's KV head) and the base-2
    log-sum-exp scale q.k log2(e). q [T, h, d], k and v [T, kvh, d]."""
    group = q.shape[1] // k.shape[1]
    kx = k.repeat_interleave(group, dim=1)
    s = (q.float() * kx.float()).sum(-1) * (scale * LOG2E)
    return v.repeat_interleave(group, dim=1), s


def merge_states(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """Attention over segments A and B from each one's output [T, h, d] and base-2 log-sum-exp [T, h]; B must
    not be empty. An empty A (s_a -inf or NaN) weighs 0 and its output is not read (it may be NaN)."""
    s_a = torch.nan_to_num(s_a.float(), nan=float("-inf"), posinf=float("-inf"))
    s_b = s_b.float()
    m = torch.maximum(s_a, s_b)
    w_a = torch.exp2(s_a - m).unsqueeze(-1)
    w_b = torch.exp2(s_b - m).unsqueeze(-1)
    num = torch.where(w_a > 0, o_a.float() * w_a, 0.0) + o_b.float() * w_b
    return (num / (w_a + w_b)).to(o_b.dtype)


class FlashInferAttention:
    """FlashInfer wrappers of one torch backend: `plan` once per step on the host, `attend` in each layer."""

    def __init__(self, num_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, buckets: list[int] | tuple[int, ...] = (), width: int = 0,
                 flashinfer: Any = None) -> None:
        fi = flashinfer if flashinfer is not None else importlib.import_module("flashinfer")
        self.num_heads, self.kv_heads, self.head_dim, self.block_size = num_heads, kv_heads, head_dim, block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = 1.0 / math.sqrt(head_dim)
        # the decode wrapper's own kernels cover small groups; larger ones go through the tensor-core
        # (prefill) kernels, as FlashInfer recommends for GQA groups above 4
        tensor_cores = num_heads // kv_heads > 4
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.paged = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tensor_cores)
        self.bucket_decode: dict[int, Any] = {}
        for b in buckets:
            i32 = dict(dtype=torch.int32, device=self.device)
            self.bucket_decode[b] = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(b + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(b * max(1, width), **i32),
                paged_kv_last_page_len_buffer=torch.zeros(b, **i32))
        self.mode = ""  # "decode", "mixed" (past + new) or "prefill" (new only)
        self.tokens = -1  # the planned step's token count
        self._decode: Any = None

    def plan(self, cu_seqlens: np.ndarray, past_lens: np.ndarray, block_table: np.ndarray,
             bucket: int | None = None, pad_from: int | None = None, pad_block: int = 0) -> None:
        """Plan the step for every layer: the decode wrapper when each sequence has one new token (`bucket`:
        that bucket's CUDA-graph wrapper), else the ragged wrapper and, when any sequence has a past, the
        paged one. Becomes the plan `active()` returns."""
        global _active
        meta = page_metadata(cu_seqlens, past_lens, block_table, self.block_size, pad_from, pad_block)
        ten = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in meta.items()}
        qo = meta["qo_indptr"]
        new = np.diff(qo)
        heads = (self.num_heads, self.kv_heads, self.head_dim)
        types = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        if bucket is not None or (len(new) and bool((new == 1).all())):
            wrapper = self.bucket_decode[bucket] if bucket is not None else self.decode
            wrapper.plan(ten["kv_indptr"], ten["kv_indices"], ten["last_page_len"], *heads, self.block_size, **types)
            self.mode, self._decode = "decode", wrapper
        else:
            self.ragged.plan(ten["qo_indptr"], ten["qo_indptr"], *heads, causal=True, **types)
            self.mode = "prefill"
            if int(meta["kv_indptr"][-1]) > 0:
                self.paged.plan(ten["qo_indptr"], ten["kv_indptr"], ten["kv_indices"], ten["last_page_len"], *heads,
                                self.block_size, causal=False, **types)
                self.mode = "mixed"
        self.tokens = int(qo[-1]) if len(qo) else 0
        _active = self

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One layer of the planned step: q [T, h*d], k and v [T, kvh*d], the layer's pools -> [T, h*d]."""
        t = q.shape[0]
        h, kvh, d = self.num_heads, self.kv_heads, self.head_dim
        if t != self.tokens:
            raise RuntimeError(f"the FlashInfer plan is for a step of {self.tokens} tokens; the op got {t}")
        q3 = q.reshape(t, h, d)
        if not math.isclose(scale, self.scale, rel_tol=1e-6):
            q3 = q3 * (scale / self.scale)
        k3, v3 = k.reshape(t, kvh, d), v.reshape(t, kvh, d)
        if self.mode == "decode":
            o_p, s_p = self._decode.run_return_lse(q3, (k_cache, v_cache))
            o_n, s_n = single_key_state(q3, k3, v3, self.scale)
        else:
            o_n, s_n = self.ragged.run_return_lse(q3, k3, v3)
            if self.mode == "prefill":
                return o_n.reshape(t, h * d)
            o_p, s_p = self.paged.run_return_lse(q3, (k_cache, v_cache))
        return merge_states(o_p, s_p, o_n, s_n).reshape(t, h * d)


__all__ = ["FlashInferAttention", "active", "merge_states", "page_metadata", "single_key_state"]
