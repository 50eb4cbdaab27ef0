"""For a checkpoint our model definition does not cover: the nearest supported family and what differs.

`nearest_family(cfg)` compares a Hugging Face `config.json` with the families of
compiler/models/llama.py (FAMILIES: one decoder with RMSNorm, RoPE, GQA and a SiLU-gated MLP, differing in
QKV bias, q/k RMSNorm, sliding windows, multipliers, fused weights, partial rotary and norm placement). The comparison
reads config keys (activation, norm, soft-capping, experts (nearest then a mixture-of-experts family),
latent attention, rotary, multipliers,
...) plus, for a few well-known model types, what their config does not say (Gemma's (1+w)
RMSNorm, fused projection weights, ...). The dry run and the build print it when they refuse a
checkpoint, so the message says how far the checkpoint is from one we build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the RoPE scaling types the model definition computes (compiler/checkpoint.py refuses others)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

# model_type of each supported family -> its architecture name
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# the mixture-of-experts family of a dense one's attention (a checkpoint with experts is nearest to it)
_MOE_OF = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe"}

_NON_GATED = "a non-gated MLP (fc in -> activation -> fc out; ours: gate_proj/up_proj/down_proj)"
# model_type -> (nearest family, differences its config keys do not show)
KNOWN: dict[str, tuple[str, list[str]]] = {
    "gemma": ("gemma2", ["RMSNorm before each branch only (gemma2: before and after)"]),
    "phi": ("llama", [_NON_GATED, "a bias on every projection"]),
    "cohere": ("llama", ["attention and MLP in parallel on one residual (ours: one after the other)"]),
    "starcoder2": ("mistral", [_NON_GATED, "a bias on every projection"]),
    "gpt2": ("llama", ["learned absolute position embeddings (ours: RoPE)", _NON_GATED,
                       "fused c_attn Conv1D weights"]),
    "gpt_neox": ("llama", [_NON_GATED, "fused query_key_value weights"]),
    "falcon": ("llama", [_NON_GATED, "fused query_key_value weights"]),
    "stablelm": ("llama", []),
    "deepseek_v2": ("llama", []),
    "deepseek_v3": ("llama", []),
}


@dataclass(frozen=True)
class Nearest:
    family: str  # model_type of the nearest supported family
    architecture: str
    differences: tuple[str, ...]

    def describe(self, model_type: str) -> str:
        head = f"nearest supported family: {self.family} ({self.architecture})"
        if not self.differences:
            return head + f"; {model_type} differs in nothing its config shows (its weight names may still differ)"
        return head + f"; {model_type} differs in:\n" + "\n".join(f"  - {d}" for d in self.differences)


def _num(cfg: dict[str, Any], *keys: str) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) not in (None, False, 0)), None)


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = next(iter(rope.values()))  # per layer type (Gemma 3): the first is enough here
    return rope if isinstance(rope, dict) else {}


def config_differences(cfg: dict[str, Any], gated: bool = True, family: str = "llama") -> list[str]:
    """What `cfg` asks for that `family` does not do, from its config keys (`gated`: whether its MLP is
    gated like ours, which the config does not say)."""
    out: list[str] = []
    act = _num(cfg, "hidden_activation", "hidden_act", "activation_function")
    if act is not None and (act not in ("silu", "gelu_pytorch_tanh") or not gated):
        gelu = str(act).startswith("gelu")
        kind = ("GeGLU" if gelu else f"{act}-gated") if gated else ("GELU" if gelu else str(act))
        out.append(f"{kind} activation ({act!r}; ours: gated SiLU or tanh-GELU)")
    if "rms_norm_eps" not in cfg and _num(cfg, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
        out.append("LayerNorm (ours: RMSNorm)")
    for key, what in (("attn_logit_softcapping", "attention-logit soft-capping"),
                      ("final_logit_softcapping", "final-logit soft-capping")):
        if cfg.get(key) and family != "gemma2":
            out.append(f"{what} ({key}={cfg[key]})")
    if cfg.get("query_pre_attn_scalar") and family != "gemma2":
        out.append(f"attention scale 1/sqrt(query_pre_attn_scalar={cfg['query_pre_attn_scalar']}) "
                   "(ours: 1/sqrt(head_dim))")
    experts = _num(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    if experts and family not in _MOE_OF.values():
        per_token = _num(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk")
        out.append(f"mixture of experts ({experts} experts" + (f", {per_token} per token" if per_token else "")
                   + "; ours: one dense MLP)")
    if cfg.get("kv_lora_rank"):
        out.append(f"multi-head latent attention (kv_lora_rank={cfg['kv_lora_rank']})")
    rope = _rope(cfg)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        out.append(f"RoPE type {rope_type!r} (ours: {', '.join(ROPE_TYPES)})")
    if cfg.get("use_parallel_residual") or cfg.get("parallel_attn"):
        out.append("attention and MLP in parallel on one residual (ours: one after the other)")
    scales = [f"{k}={cfg[k]}" for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                       "logits_scaling", "logit_scale", "scale_emb", "scale_depth")
              if cfg.get(k) not in (None, 1, 1.0)]
    if scales:
        out.append(f"scaled embeddings / residuals / logits ({', '.join(scales)})")
    if cfg.get("qk_layernorm") or cfg.get("use_qk_norm"):
        out.append("q/k LayerNorm")
    return out


def nearest_family(cfg: dict[str, Any]) -> Nearest:
    """The supported family closest to `cfg` (a config.json of an architecture we do not build)."""
    model_type = str(cfg.get("model_type") or "")
    known = KNOWN.get(model_type)
    extra: list[str] = []
    if known is not None:
        family, extra = known[0], list(known[1])
    elif (prefix := next((f for f in FAMILIES if model_type.startswith(f)), None)) is not None:
        family = prefix  # qwen2_vl, mistral3, llama4_text, ...
    elif cfg.get("qk_norm") or cfg.get("use_qk_norm") or cfg.get("qk_layernorm"):
        family = "qwen3"
    elif cfg.get("use_qkv_bias") or cfg.get("qkv_bias"):
        family = "qwen2"
    elif cfg.get("sliding_window") and not cfg.get("layer_types"):
        family = "mistral"
    else:
        family = "llama"
    if _num(cfg, "num_local_experts", "num_experts", "n_routed_experts") and family in _MOE_OF:
        family = _MOE_OF[family]
    differences = config_differences(cfg, gated=_NON_GATED not in extra, family=family)
    if family in ("qwen3", "qwen3_moe"):  # Qwen3 has q/k norms (RMSNorm)
        differences = [d for d in differences if d != "q/k LayerNorm"]
    return Nearest(family, FAMILIES[family], tuple(differences + extra))


__all__ = ["FAMILIES", "KNOWN", "Nearest", "config_differences", "nearest_family"]
