"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) of our model definition, and the
loading of its checkpoint layouts.

Routing is as transformers computes it: router logits = x W_r^T, softmax in float32, the top k experts of
each token, their k weights renormalised to sum 1 where the family does (Mixtral always; Qwen when
`norm_topk_prob`). Each expert is a gated MLP with its own three Linears, so every quantization pass
and fusion rule that handles a dense MLP handles an expert too.

The forward computes only the selected experts' work: for expert e, NonZero(selected == e) lists the
(token, slot) pairs routed to it, its MLP runs on those tokens' rows alone (0 rows when no token chose
it: an empty GEMM), and the rows are written back to their (token, slot) place, weighted and summed
over the k slots. torch.export keeps the row counts as data-dependent sizes, and the ONNX graph is
NonZero / Gather / Gemm / ScatterND in standard ops, so an ONNX Runtime CPU step does work in
proportion to T x k rather than T x num_experts (bench/moe.py measures it). Qwen2-MoE's shared expert
runs on every token, scaled by sigmoid(x w_g).

The routers (and the shared expert's gate) are `Router` modules rather than nn.Linear: they stay in
float through every quantization (their outputs pick the experts; they are a tiny share of the weights).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from compiler.checkpoint import ModelConfig


class Router(nn.Module):
    """x -> x W^T with W [out, in]: the experts' router and the shared expert's gate (kept in float)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: type[nn.Module]) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleList([mlp(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:
            self.shared_expert = mlp(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(cfg.hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k]) of each token."""
        probs = torch.softmax(self.gate(x).to(torch.float32), dim=-1)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, selected

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.top_k
        weights, selected = self.route(x)
        flat = selected.reshape(-1)  # [T * k]: slot j of token t at t * k + j
        token_of = torch.arange(t, dtype=torch.int64).unsqueeze(1).expand(t, k).reshape(-1)
        rows, outs = [], []
        for e, expert in enumerate(self.experts):
            pairs = torch.nonzero(flat == e).squeeze(-1)  # the (token, slot) pairs routed to expert e
            outs.append(expert(torch.index_select(x, 0, torch.index_select(token_of, 0, pairs))))
            rows.append(pairs)
        y = torch.zeros(t * k, x.shape[1], dtype=x.dtype).index_copy(0, torch.cat(rows), torch.cat(outs))
        out = (y.view(t, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# Checkpoint layouts of the experts -> our names (layers.N.mlp.experts.E.{gate,up,down}_proj.weight)
_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.w[123]\.weight)$")
_MIXTRAL_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def normalize_expert_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert tensors under our per-expert names, from any of the layouts checkpoints carry:

    - Mixtral's original `block_sparse_moe.experts.E.w1/w3/w2` (gate, up, down) and `block_sparse_moe.gate`;
    - per-expert `mlp.experts.E.{gate,up,down}_proj` (Qwen-MoE, and transformers 5's save format);
    - transformers 5's in-memory fused 3-D tensors `mlp.experts.gate_up_proj` [E, 2 I, H] (gate rows
      first) and `mlp.experts.down_proj` [E, H, I]."""
    if not cfg.num_experts:
        return weights
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if m := _MIXTRAL.match(name):
            rest = m.group(2)
            if rest.startswith("experts."):
                _, e, kind, _ = rest.split(".")
                rest = f"experts.{e}.{_MIXTRAL_W[kind]}.weight"
            out[f"{m.group(1)}mlp.{rest}"] = w
        elif m := _FUSED.match(name):
            if w.shape[0] != cfg.num_experts:
                raise ValueError(f"tensor {name}: {w.shape[0]} experts, the config says {cfg.num_experts}")
            for e in range(cfg.num_experts):
                if m.group(2) == "down_proj":
                    out[f"{m.group(1)}{e}.down_proj.weight"] = w[e]
                else:
                    gate, up = torch.chunk(w[e], 2, dim=0)
                    out[f"{m.group(1)}{e}.gate_proj.weight"] = gate
                    out[f"{m.group(1)}{e}.up_proj.weight"] = up
        else:
            out[name] = w
    return out


__all__ = ["Router", "SparseMoeBlock", "normalize_expert_weights"]
