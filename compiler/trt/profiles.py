"""Optimization profiles of a TensorRT engine: the range (min, opt, max) of every dynamic input dim.

A TensorRT engine runs only the shapes its profiles cover, and tunes its kernels for each profile's
`opt` shapes. The ForwardBatch inputs have four dynamic sizes — tokens T, sequences B, block-table
width W, logits rows L — plus the pool size N; the profiles are:

| profile | T | B | W | L | used for |
|---|---|---|---|---|---|
| `mixed` | 1..max_num_batched_tokens (opt: max) | 1..max_num_seqs | 1..Wmax | 1..max_num_batched_tokens (opt: max_num_seqs) | prefill chunks and mixed steps |
| `decode` | 1..max_num_seqs | 1..max_num_seqs | 1..Wmax | 1..max_num_seqs | decode steps run without a CUDA graph |
| `decode_b<n>` | n | n | Wmax | n | the CUDA graph of decode bucket n (all fixed) |

with Wmax = ceil(max_model_len / block_size). The pools are [1..N, block_size, kv_heads, head_dim]
(opt N = the recipe's num_kv_blocks), so a runtime may allocate fewer blocks but not more. Each
CUDA-graph bucket has a profile of its own because a TensorRT execution context owns its profile
(two contexts cannot use one profile at the same time) and a graph is captured from one context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORWARD_BATCH_INPUTS = ("input_ids", "positions", "cu_seqlens", "past_lens", "block_table", "logits_index")


@dataclass(frozen=True)
class EngineLimits:
    """The serving limits an engine is built for (runtime.json's scheduler and KV-cache facts)."""

    max_num_tokens: int  # max_num_batched_tokens
    max_num_seqs: int
    max_blocks_per_seq: int  # ceil(max_model_len / block_size)
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int

    def record(self) -> dict[str, int]:
        return {"max_num_tokens": self.max_num_tokens, "max_num_seqs": self.max_num_seqs,
                "max_blocks_per_seq": self.max_blocks_per_seq, "num_blocks": self.num_blocks}


@dataclass(frozen=True)
class ProfileSpec:
    name: str
    bucket: int | None  # the decode batch size of a CUDA-graph profile, else None
    shapes: dict[str, tuple[list[int], list[int], list[int]]]  # input -> (min, opt, max)

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.bucket is not None:
            out["bucket"] = self.bucket
        out["shapes"] = {k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in self.shapes.items()}
        return out


def _step_shapes(t: int, b: int, w: int, n_logits: int) -> dict[str, list[int]]:
    return {"input_ids": [t], "positions": [t], "cu_seqlens": [b + 1], "past_lens": [b], "block_table": [b, w],
            "logits_index": [n_logits]}


def engine_profiles(input_names: list[str], limits: EngineLimits, buckets: list[int] | tuple[int, ...] = ()
                    ) -> list[ProfileSpec]:
    """The `mixed` and `decode` profiles, then one per CUDA-graph decode bucket (see the module doc)."""
    lim = limits
    unknown = [n for n in input_names if n not in FORWARD_BATCH_INPUTS and not n.startswith(("key_cache.",
                                                                                            "value_cache."))]
    if unknown:
        raise ValueError(f"graph inputs {unknown} are not ForwardBatch inputs or KV pools")
    if lim.max_num_tokens < lim.max_num_seqs:
        raise ValueError(f"max_num_tokens {lim.max_num_tokens} < max_num_seqs {lim.max_num_seqs}")
    bad = [b for b in buckets if not 1 <= b <= lim.max_num_seqs]
    if bad:
        raise ValueError(f"decode buckets {bad} outside 1..max_num_seqs ({lim.max_num_seqs})")
    pool = ([1, lim.block_size, lim.kv_heads, lim.head_dim], [lim.num_blocks, lim.block_size, lim.kv_heads,
                                                             lim.head_dim])
    wmax = lim.max_blocks_per_seq

    def spec(name: str, bucket: int | None, lo: dict[str, list[int]], opt: dict[str, list[int]],
             hi: dict[str, list[int]]) -> ProfileSpec:
        shapes: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for n in input_names:
            if n in lo:
                shapes[n] = (lo[n], opt[n], hi[n])
            else:  # a KV pool
                shapes[n] = (pool[0], pool[1], pool[1])
        return ProfileSpec(name, bucket, shapes)

    tmax, bmax = lim.max_num_tokens, lim.max_num_seqs
    out = [
        spec("mixed", None, _step_shapes(1, 1, 1, 1), _step_shapes(tmax, bmax, wmax, bmax),
             _step_shapes(tmax, bmax, wmax, tmax)),
        spec("decode", None, _step_shapes(1, 1, 1, 1), _step_shapes(bmax, bmax, wmax, bmax),
             _step_shapes(bmax, bmax, wmax, bmax)),
    ]
    for b in buckets:
        fixed = _step_shapes(b, b, wmax, b)
        out.append(spec(f"decode_b{b}", b, fixed, fixed, fixed))
    return out


__all__ = ["FORWARD_BATCH_INPUTS", "EngineLimits", "ProfileSpec", "engine_profiles"]
