"""Our model definition for the Llama-shaped families with the ForwardBatch interface: one decoder whose flags
(ModelConfig) each family's declaration sets (compiler/models/families.py FAMILY_TABLE: Llama, Mistral, Qwen2,
Qwen3, Granite, Phi-3, OLMo 2, Gemma 2/3, the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, ...).

One forward runs any mix of prefill chunks and decode tokens, packed without padding. Attention is
a paged attention written in standard ops (so it exports to plain ONNX):

    token t of sequence b=seq(t) at position p attends to
      past keys   j in [0, past_lens[b])      read from the KV pool through block_table[b]
      new keys    t' with seq(t') == b and positions[t'] <= p   (this step's own K/V)

The forward returns the logits of the `logits_index` tokens and each layer's new K/V ([T, kv_heads,
head_dim]); the runtime scatters those into its pool at `slot_mapping` after the step, so the graph
never copies the pool. Weights load from Hugging Face names.

`attention` picks the attention variant (compiler/attention/, chosen by the select_attention pass):
"decomposed" is the paged attention above in standard ops; "gqa", "paged_cpu" and "paged_attention" call
a custom op over the same packed tokens and pools whose ONNX translation is ONNX Runtime's
GroupQueryAttention contrib op, our optimize.PagedAttention (a C kernel) or ONNX Runtime's PagedAttention (q/k norm and RoPE stay in our graph); "triton"
(torch targets) calls optimize::paged_attention_triton, a Triton kernel on CUDA; "flashinfer" (torch
targets) calls optimize::paged_attention_flashinfer, FlashInfer's kernels on CUDA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from compiler.checkpoint import ModelConfig
from compiler.models.moe import SparseMoeBlock, normalize_expert_weights


def local_rope_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the sliding-window layers' own RoPE (Gemma 3's local base) in place of the global one."""
    if cfg.local_rope_theta is None:
        return cfg
    return dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling)


def rope_dim(cfg: ModelConfig) -> int:
    """Dimensions of a head that RoPE turns (partial_rotary_factor * head_dim; all by default)."""
    return cfg.rotary_dim or cfg.head_dim


def _yarn_factor(cfg: ModelConfig) -> float:
    sc = cfg.rope_scaling or {}
    factor = sc.get("factor")
    original = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    return float(factor) if factor is not None else cfg.max_position_embeddings / original


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor Hugging Face multiplies cos and sin by (YaRN's attention factor; 1 for the other types).

    Both q and k are rotated with it, so where the whole head turns every attention score carries its
    square: the model folds that into the softmax scale instead of scaling cos/sin (the same numbers up
    to float rounding, and the graph's rotation stays the plain one that the fusion rules and kernels
    know). Under a partial rotation only the turned dimensions carry it: there cos/sin are scaled."""
    sc = cfg.rope_scaling
    kind = None if sc is None else sc.get("rope_type", sc.get("type"))
    if sc is None or kind not in ("yarn", "longrope"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = _yarn_factor(cfg)
    if kind == "longrope":  # Phi-3's: sqrt(1 + ln(factor) / ln(original context))
        original = float(sc["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return float(mscale(factor, float(sc["mscale"])) / mscale(factor, float(sc["mscale_all_dim"])))
    return mscale(factor)


def _yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """YaRN (NTK-by-parts): interpolated frequencies below the correction range, extrapolated above it,
    a linear ramp between (Hugging Face's _compute_yarn_parameters, float32 as there)."""
    sc = cfg.rope_scaling or {}
    dim, base = rope_dim(cfg), cfg.rope_theta
    factor = _yarn_factor(cfg)
    original = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as there: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies as Hugging Face computes them (default, linear, llama3, yarn, dynamic, longrope).

    `dynamic` (NTK) recomputes the base only for sequences longer than max_position_embeddings, which
    is where the build caps max_model_len: within it the frequencies are the default ones exactly."""
    dim = rope_dim(cfg)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "dynamic":
        return inv
    if kind == "longrope":  # the factor set compiler/checkpoint.py chose for the artifact's context
        ext = torch.tensor(sc["long_factor" if sc.get("factors") == "long" else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "yarn":
        return _yarn_inv_freq(cfg)
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(is_medium, smoothed, inv_l)
    raise ValueError(f"unsupported RoPE scaling {kind!r}")


def hf_value(cfg: ModelConfig, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Parameter `name`'s value in `dtype` from its checkpoint tensor `w` (as load_hf_state_dict copies it)."""
    if cfg.norm_weight_offset and name.endswith("norm.weight"):  # Gemma stores w - 1
        w = w.to(torch.float32) + cfg.norm_weight_offset
    return w.to(dtype)


def split_fused_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A family with `fused_weights` (Phi-3) stores q/k/v as one `qkv_proj` ([q; k; v] rows) and gate/up as
    one `gate_up_proj` ([gate; up]): the same tensors under our per-projection names (the fuse pass joins them
    again in the graph)."""
    if not cfg.fused_weights:
        return weights
    out = dict(weights)
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name in [n for n in weights if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        w, prefix = out.pop(name), name.rsplit(".", 2)[0]
        if name.endswith("qkv_proj.weight"):
            parts = torch.split(w, [q_rows, kv_rows, kv_rows], dim=0)
            names = ("q_proj", "k_proj", "v_proj")
        else:
            parts = torch.chunk(w, 2, dim=0)
            names = ("gate_proj", "up_proj")
        for part, sub in zip(parts, names, strict=True):
            out[f"{prefix}.{sub}.weight"] = part
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


ATTENTION_VARIANTS = ("decomposed", "gqa", "paged_cpu", "paged_attention", "triton", "flashinfer")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, variant: str = "decomposed") -> None:
        super().__init__()
        if variant not in ATTENTION_VARIANTS:
            raise ValueError(f"unknown attention variant {variant!r}; known: {', '.join(ATTENTION_VARIANTS)}")
        self.variant = variant
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # per head (Qwen3), or over the whole projection (OLMo 2)
            self.q_norm = RMSNorm(self.d * (self.h if cfg.qk_norm_full else 1), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d * (self.kvh if cfg.qk_norm_full else 1), cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qk_norm_full = cfg.qk_norm_full
        self.rotary_dim = rope_dim(cfg)
        # Gemma 3: the sliding-window layers turn with their own (local) RoPE base
        self.local_rope = cfg.local_rope_theta is not None and cfg.sliding_windows[layer] is not None
        rope_cfg = local_rope_config(cfg) if self.local_rope else cfg
        self.softcap = cfg.attn_logit_softcapping
        if self.softcap and variant != "decomposed":
            raise ValueError(f"attention variant {variant!r} has no logit soft-capping (the decomposed path has)")
        self.window = cfg.sliding_windows[layer]
        # YaRN's / LongRoPE's factor on q and k, folded where the whole head turns (a partial rotation
        # scales only the turned dimensions: the model scales cos/sin there); Granite's
        # attention_multiplier in place of 1/sqrt(d)
        base = cfg.attention_multiplier if cfg.attention_multiplier is not None else 1.0 / math.sqrt(self.d)
        self.scale = (rope_attention_factor(rope_cfg) ** 2 if rope_dim(cfg) == self.d else 1.0) * base

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, d]
        sin: torch.Tensor,
        ctx: AttentionContext,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kvh, d]
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        if self.variant != "decomposed":
            return self._fused(q, k, v, ctx, k_cache, v_cache), k, v

        group = self.h // self.kvh
        qg = q.view(t, self.kvh, group, self.d)
        # Past K/V of each token's sequence, gathered from the pool as [T, kvh, Lp, d] (heads before
        # positions, so the products below are plain batched MatMuls).
        qg = qg * self.scale
        rows = ctx.past_index.reshape(-1)
        kp = torch.index_select(k_cache.reshape(-1, self.d), 0, rows).view(t, self.kvh, -1, self.d)
        vp = torch.index_select(v_cache.reshape(-1, self.d), 0, rows).view(t, self.kvh, -1, self.d)
        s_past = torch.matmul(qg, kp.transpose(-1, -2))  # [T, kvh, g, Lp]
        # This step's own keys: one GEMM per KV head over all tokens, masked to the same sequence.
        qh = qg.permute(1, 0, 2, 3).reshape(self.kvh, t * group, self.d)
        s_new = torch.matmul(qh, k.permute(1, 2, 0)).view(self.kvh, t, group, t).permute(1, 0, 2, 3)
        scores = torch.cat([s_past, s_new], dim=-1)
        if self.softcap:  # Gemma 2: cap * tanh(scores / cap), before the mask
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + ctx.bias(self.window)  # [T, kvh, g, Lp + T]
        probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
        # The new keys' share regrouped per KV head before it is cut from the past's: torch 2.11's export cannot
        # prove the guard min(T, gT) == T that reshaping the cut [T, kvh, g, T] slice needs.
        lp = kp.shape[2]
        p_past = probs[..., :lp]
        p_new = probs.permute(1, 0, 2, 3).reshape(self.kvh, t * group, lp + t)[..., lp:]
        out_new = torch.matmul(p_new, v.permute(1, 0, 2)).view(self.kvh, t, group, self.d).permute(1, 0, 2, 3)
        out = torch.matmul(p_past, vp) + out_new  # [T, kvh, g, d]
        return self.o_proj(out.reshape(t, self.h * self.d)), k, v

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, h, d], k and v [T, kvh, d] of x [T, hidden]: the projections, q/k norms and the rotation
        (what the pools store as K; calibration's dense attention starts from here too)."""
        t = x.shape[0]
        if self.qk_norm_full:
            q = self.q_norm(self.q_proj(x)).view(t, self.h, self.d)
            k = self.k_norm(self.k_proj(x)).view(t, self.kvh, self.d)
        else:
            q = self.q_proj(x).view(t, self.h, self.d)
            k = self.k_proj(x).view(t, self.kvh, self.d)
        v = self.v_proj(x).view(t, self.kvh, self.d)
        if self.qk_norm and not self.qk_norm_full:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos_, sin_ = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.rotary_dim == self.d:
            q = q * cos_ + _rotate_half(q) * sin_
            k = k * cos_ + _rotate_half(k) * sin_
        else:  # partial rotary (Phi-3 family): the first rotary_dim dimensions turn, the rest pass
            r = self.rotary_dim
            q = torch.cat([q[..., :r] * cos_ + _rotate_half(q[..., :r]) * sin_, q[..., r:]], dim=-1)
            k = torch.cat([k[..., :r] * cos_ + _rotate_half(k[..., :r]) * sin_, k[..., r:]], dim=-1)
        return q, k, v

    def _fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The contrib-op variants: one custom op over the packed tokens (compiler/models/attention_ops.py)."""
        from compiler.models.attention_ops import OPS

        t = q.shape[0]
        out = OPS[self.variant](
            q.reshape(t, self.h * self.d), k.reshape(t, self.kvh * self.d), v.reshape(t, self.kvh * self.d),
            k_cache, v_cache, ctx.cu_seqlens, ctx.past_lens, ctx.block_table,
            self.h, self.kvh, self.d, ctx.block_size, self.window or 0, self.scale,
        )
        return self.o_proj(out)


class AttentionContext:
    """Index tensors shared by all layers of one step (computed once from the ForwardBatch)."""

    def __init__(
        self,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        past_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        num_kv_heads: int,
        indices: bool = True,  # False: the fused variants, which read only the ForwardBatch arrays below
    ) -> None:
        self.cu_seqlens, self.past_lens, self.block_table = cu_seqlens, past_lens, block_table
        self.block_size = block_size
        if not indices:
            self.positions = positions
            return
        t = positions.shape[0]
        tok = torch.arange(t, dtype=torch.int64)
        ends = cu_seqlens[1:].to(torch.int64)
        seq = (tok.unsqueeze(1) >= ends.unsqueeze(0)).to(torch.int64).sum(-1)  # [T] sequence of token t
        lp = block_table.shape[1] * block_size
        j = torch.arange(lp, dtype=torch.int64)
        bt = block_table.to(torch.int64).clamp(min=0)[seq]  # [T, max_blocks]
        past_slots = bt[:, j // block_size] * block_size + (j % block_size)  # [T, Lp]
        heads = torch.arange(num_kv_heads, dtype=torch.int64)
        # Row of the pool viewed as [num_blocks * block_size * kv_heads, head_dim]: [T, kvh, Lp]
        self.past_index = past_slots.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)
        self.past_pos = j.unsqueeze(0)
        self.past_mask = j.unsqueeze(0) < past_lens.to(torch.int64)[seq].unsqueeze(1)  # [T, Lp]
        self.new_mask = (seq.unsqueeze(1) == seq.unsqueeze(0)) & (
            positions.unsqueeze(0) <= positions.unsqueeze(1)
        )  # [T, T]
        self.positions = positions
        self._bias: dict[int | None, torch.Tensor] = {}

    def bias(self, window: int | None) -> torch.Tensor:
        """Additive mask [T, 1, 1, Lp + T] (0 or -inf), built once per step for each window size."""
        if window not in self._bias:
            past_ok, new_ok = self.past_mask, self.new_mask
            if window is not None:
                past_ok = past_ok & (self.past_pos > self.positions.unsqueeze(1) - window)
                new_ok = new_ok & (self.positions.unsqueeze(0) > self.positions.unsqueeze(1) - window)
            ok = torch.cat([past_ok, new_ok], dim=-1)[:, None, None, :]
            zero = torch.zeros((), dtype=torch.float32)
            self._bias[window] = torch.where(ok, zero, torch.full((), float("-inf")))
        return self._bias[window]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.activation = cfg.mlp_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        act = nn.functional.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else \
            nn.functional.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, attention: str = "decomposed") -> None:
        super().__init__()
        if not cfg.post_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, attention)
        # pre-norm: the MLP's input norm; post-norm (OLMo 2): the attention output's norm (transformers' names)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.post_norm or cfg.sandwich_norm:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norm:  # Gemma 2: post_attention_layernorm is the attention output's, this the MLP input's
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Mixtral / Qwen-MoE: the sparse layers' experts (compiler/models/moe.py)
        self.mlp = SparseMoeBlock(cfg, MLP) if cfg.is_moe_layer(layer) else MLP(cfg)


class LlamaForwardBatchModel(nn.Module):
    """The decoder of every supported family, taking the ForwardBatch arrays plus the per-layer KV pools."""

    def __init__(self, cfg: ModelConfig, block_size: int, attention: str = "decomposed") -> None:
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.attention = attention
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, attention) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.local_rope_theta is not None:
            self.register_buffer("inv_freq_local", rope_inv_freq(local_rope_config(cfg)), persistent=False)

    @classmethod
    def without_weights(cls, cfg: ModelConfig, block_size: int, attention: str = "decomposed") -> LlamaForwardBatchModel:
        """The model with uninitialised parameter storage (no random init: load_hf_state_dict fills every
        parameter) and its RoPE frequency buffers computed as __init__ does."""
        with torch.device("meta"):
            model = cls(cfg, block_size, attention)
        model = model.to_empty(device="cpu")
        buffers = {name for name, _ in model.named_buffers()}
        if not buffers <= {"inv_freq", "inv_freq_local"}:  # a new buffer must be computed here too
            raise AssertionError(f"buffers without a value: {sorted(buffers - {'inv_freq', 'inv_freq_local'})}")
        model.inv_freq = rope_inv_freq(cfg)
        if cfg.local_rope_theta is not None:
            model.inv_freq_local = rope_inv_freq(local_rope_config(cfg))
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        past_lens: torch.Tensor,
        block_table: torch.Tensor,
        logits_index: torch.Tensor,
        *kv_cache: torch.Tensor,  # k_0, v_0, k_1, v_1, ...
    ) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        x = self.embed(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        cos_l, sin_l = self.rope_cos_sin(positions, x.dtype, local=True) if cfg.local_rope_theta is not None \
            else (cos, sin)
        ctx = AttentionContext(positions, cu_seqlens, past_lens, block_table, self.block_size, cfg.num_kv_heads,
                               indices=self.attention == "decomposed")
        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            kv: list[torch.Tensor] = []

            def attend(xn: torch.Tensor, layer: nn.Module = layer, i: int = i, kv: list = kv) -> torch.Tensor:
                c, s = (cos_l, sin_l) if layer.self_attn.local_rope else (cos, sin)
                h, k, v = layer.self_attn(xn, c, s, ctx, kv_cache[2 * i], kv_cache[2 * i + 1])
                kv += [k, v]
                return h

            x = self.layer_forward(layer, x, attend)
            new_kv += kv
        return (self.head(x[logits_index]), *new_kv)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of the last layer's residual x: final norm, lm_head, scaling, soft-capping."""
        cfg = self.cfg
        logits = self.lm_head(self.norm(x)).to(torch.float32)
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcapping:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    # -- the pieces of the forward that calibration (compiler/quant/calibration.py) runs layer by layer --
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.cfg.embedding_multiplier if self.cfg.embedding_multiplier != 1.0 else x

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] of each token's position, in `dtype` (angles in float32); `local`: the
        sliding-window layers' RoPE (Gemma 3)."""
        cfg = local_rope_config(self.cfg) if local else self.cfg
        freqs = positions.to(torch.float32).unsqueeze(1) * (self.inv_freq_local if local else self.inv_freq).unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        factor = rope_attention_factor(cfg) if rope_dim(cfg) != cfg.head_dim else 1.0
        if factor != 1.0:  # a partial rotation: on cos/sin, as transformers
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def attention_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What layer.self_attn reads: the normalised residual (pre-norm), the residual itself (post-norm)."""
        return x if self.cfg.post_norm else layer.input_layernorm(x)

    def layer_forward(self, layer: nn.Module, x: torch.Tensor, attend: Any, mlp: Any = None) -> torch.Tensor:
        """One decoder layer on the residual x; `attend(attention input) -> attention output`, `mlp(MLP input) ->
        MLP output` (layer.mlp unless given)."""
        rm = self.cfg.residual_multiplier
        mlp = layer.mlp if mlp is None else mlp
        if self.cfg.sandwich_norm:  # Gemma 2: norms before and after each branch
            x = x + layer.post_attention_layernorm(attend(layer.input_layernorm(x)))
            return x + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(x)))
        if self.cfg.post_norm:  # OLMo 2: the norms on the branches' outputs, before the residual adds
            x = x + layer.post_attention_layernorm(attend(x))
            return x + layer.post_feedforward_layernorm(mlp(x))
        h = attend(layer.input_layernorm(x))
        x = x + (h if rm == 1.0 else h * rm)
        m = mlp(layer.post_attention_layernorm(x))
        return x + (m if rm == 1.0 else m * rm)

    # -- weights -------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        if name.startswith("lm_head."):
            return name
        return "model." + name

    def load_hf_state_dict(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                           defer: Callable[[str, torch.nn.Parameter], bool] | None = None) -> list[str]:
        """Copy Hugging Face tensors in by name; returns the HF names that were not used.

        Parameters for which `defer(name, param)` is true are not read: their checkpoint names go to
        `self.deferred_sources` (parameter -> tensor) and `hf_value` gives their values later."""
        weights = normalize_expert_weights(self.cfg, split_fused_weights(self.cfg, weights))
        used: set[str] = set()
        missing: list[str] = []
        self.deferred_sources: dict[str, str] = {}
        with torch.no_grad():
            for name, param in self.named_parameters():
                src = self.hf_name(name)
                if src == "lm_head.weight" and self.cfg.tie_word_embeddings:
                    src = "model.embed_tokens.weight"
                if src not in weights and src == "lm_head.weight":
                    src = "model.embed_tokens.weight"  # checkpoints that omit a tied head
                if src not in weights:
                    missing.append(src)
                    continue
                shape = weights.shape(src) if hasattr(weights, "shape") else tuple(weights[src].shape)
                if tuple(shape) != tuple(param.shape):
                    raise ValueError(f"tensor {src}: shape {tuple(shape)} != expected {tuple(param.shape)}")
                used.add(src)
                if defer is not None and defer(name, param):
                    self.deferred_sources[name] = src
                    if param.dtype != dtype:  # unwritten storage of the target dtype: the cast below never reads it
                        param.data = torch.empty(param.shape, dtype=dtype)
                    continue
                param.copy_(self.hf_value(name, weights[src], dtype))
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {', '.join(missing[:8])}")
        self.cast(dtype)
        return sorted(set(weights) - used - {"lm_head.weight"})

    def hf_value(self, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Parameter `name`'s value in `dtype` from its checkpoint tensor `w`."""
        return hf_value(self.cfg, name, w, dtype)

    def cast(self, dtype: torch.dtype) -> None:
        """Parameters to `dtype`; the RoPE frequencies stay float32 (the angles are computed in float32)."""
        self.to(dtype)
        self.inv_freq = self.inv_freq.to(torch.float32)
        if self.cfg.local_rope_theta is not None:
            self.inv_freq_local = self.inv_freq_local.to(torch.float32)
