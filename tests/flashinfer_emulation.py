"""A CPU stand-in for the three FlashInfer wrappers runtime/kernels/flashinfer_attention.py uses, written from
FlashInfer's documented semantics, so the planning (page lists, last-page lengths, which wrapper runs) and the
log-sum-exp merge are checked against the reference on a machine without a GPU or FlashInfer.

Semantics reproduced (flashinfer.BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
BatchDecodeWithPagedKVCacheWrapper, NHD layout):
- a request's paged keys are pages kv_indices[kv_indptr[i]:kv_indptr[i+1]] in order, its length
  max(pages - 1, 0) * page_size + last_page_len[i] (flashinfer.page.get_seq_lens);
- causal masks align the queries to the end of the keys (query j of qo_len sees keys <= kv_len - qo_len + j);
- run_return_lse returns the output in q's dtype and the log-sum-exp of the scaled logits in base 2;
- sm_scale defaults to 1/sqrt(head_dim);
- a decode wrapper made with use_cuda_graph=True has a fixed batch size (its indptr buffer's length - 1).
Stricter than the real kernels where they are unspecified: an empty request's output is NaN (its lse is
-inf), so a caller that reads it instead of weighting it out fails. Plans check their arguments: int32 CPU
tensors, consistent lengths, pages inside the pool at run time.
"""

from __future__ import annotations

import math

import torch


def _int32(name: str, t: torch.Tensor) -> torch.Tensor:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", (name, t)
    return t


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, h, d], keys/vals [K, kvh, d] -> out [Q, h, d] (q's dtype), lse base 2 [Q, h]."""
    nq, h, d = q.shape
    group = h // keys.shape[1]
    if keys.shape[0] == 0:
        return torch.full_like(q, float("nan")), torch.full((nq, h), float("-inf"))
    kx = keys.repeat_interleave(group, dim=1).permute(1, 0, 2).float()  # [h, K, d]
    vx = vals.repeat_interleave(group, dim=1).permute(1, 0, 2).float()
    s = torch.matmul(q.permute(1, 0, 2).float(), kx.transpose(1, 2)) * scale  # [h, Q, K]
    if causal:
        nk = keys.shape[0]
        ok = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
        s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # natural log [h, Q]
    out = torch.matmul(torch.softmax(s, dim=-1), vx)
    return out.permute(1, 0, 2).to(q.dtype), (lse / math.log(2)).permute(1, 0)


class _Paged:
    def _set_pages(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor, page_size: int) -> None:
        self.kv_indptr = _int32("kv_indptr", kv_indptr).tolist()
        self.kv_indices = _int32("kv_indices", kv_indices).tolist()
        self.last = _int32("last_page_len", last).tolist()
        assert len(self.kv_indices) >= self.kv_indptr[-1] and len(self.last) == len(self.kv_indptr) - 1
        for i, n in enumerate(self.last):
            pages = self.kv_indptr[i + 1] - self.kv_indptr[i]
            assert (n == 0) if pages == 0 else (1 <= n <= page_size), (i, pages, n)
        self.page_size = page_size

    def _keys(self, i: int, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = cache
        pages = self.kv_indices[self.kv_indptr[i]: self.kv_indptr[i + 1]]
        assert all(0 <= p < k_cache.shape[0] for p in pages), pages
        n = max(len(pages) - 1, 0) * self.page_size + self.last[i]
        kv = k_cache.shape[2:]
        keys = k_cache[pages].reshape(-1, *kv)[:n] if pages else k_cache.new_zeros((0, *kv))
        vals = v_cache[pages].reshape(-1, *kv)[:n] if pages else v_cache.new_zeros((0, *kv))
        return keys, vals


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD"
        self.plans = 0

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             causal: bool = False, q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None, sm_scale: float | None = None) -> None:
        self.qo = _int32("qo_indptr", qo_indptr).tolist()
        assert len(self.qo) == len(kv_indptr)
        self._set_pages(kv_indptr, kv_indices, last_page_len, page_size)
        self.causal, self.scale = causal, sm_scale or 1 / math.sqrt(head_dim)
        self.q_dtype = q_data_type
        self.plans += 1

    def run_return_lse(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        assert q.dtype == self.q_dtype and q.shape[0] == self.qo[-1]
        outs, lses = zip(*[_attend(q[self.qo[i]: self.qo[i + 1]], *self._keys(i, cache), self.causal, self.scale)
                           for i in range(len(self.qo) - 1)], strict=True)
        return torch.cat(outs), torch.cat(lses)


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD"
        self.plans = 0

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, causal: bool = False, q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None, sm_scale: float | None = None) -> None:
        self.qo = _int32("qo_indptr", qo_indptr).tolist()
        self.kv = _int32("kv_indptr", kv_indptr).tolist()
        self.causal, self.scale = causal, sm_scale or 1 / math.sqrt(head_dim)
        self.q_dtype = q_data_type
        self.plans += 1

    def run_return_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert q.dtype == self.q_dtype and q.shape[0] == self.qo[-1] and k.shape[0] == self.kv[-1]
        outs, lses = zip(*[_attend(q[self.qo[i]: self.qo[i + 1]], k[self.kv[i]: self.kv[i + 1]],
                                   v[self.kv[i]: self.kv[i + 1]], self.causal, self.scale)
                           for i in range(len(self.qo) - 1)], strict=True)
        return torch.cat(outs), torch.cat(lses)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        assert kv_layout == "NHD"
        self.batch = None
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_last_page_len_buffer is not None
            self.batch = paged_kv_indptr_buffer.shape[0] - 1
            assert paged_kv_last_page_len_buffer.shape[0] == self.batch
            self.max_pages = paged_kv_indices_buffer.shape[0]
        self.plans = 0

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None, sm_scale: float | None = None) -> None:
        self._set_pages(indptr, indices, last_page_len, page_size)
        if self.batch is not None:  # CUDA-graph mode: the batch size is fixed, the pages fit the buffer
            assert len(self.last) == self.batch and self.kv_indptr[-1] <= self.max_pages
        self.scale = sm_scale or 1 / math.sqrt(head_dim)
        self.q_dtype = q_data_type
        self.plans += 1

    def run_return_lse(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        assert q.dtype == self.q_dtype and q.shape[0] == len(self.last)
        outs, lses = zip(*[_attend(q[i: i + 1], *self._keys(i, cache), False, self.scale)
                           for i in range(len(self.last))], strict=True)
        return torch.cat(outs), torch.cat(lses)
