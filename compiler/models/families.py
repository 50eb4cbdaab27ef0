"""The model families, one declaration each, and the nearest supported family for a checkpoint outside them.

compiler/models/llama.py is one decoder (RMSNorm, RoPE, GQA, a gated MLP) that runs on the flags of
`ModelConfig` (compiler/checkpoint.py): QKV bias, q/k RMSNorm, sliding windows, multipliers, fused weights,
partial rotary, norm placement, soft-capping, experts. A family is one `Family` in FAMILY_TABLE: its
architecture names and `model_type`; `reads`, the flags it sets and how each is read from `config.json`
(a constant, a `Read` of config keys with its default and conversion, or a function of the config and the
common facts); `refusals`, the configs of its architecture it does not build, each with its message; `moe`,
the mixture-of-experts family of its attention; `resembles`, what makes an unknown config nearest to it;
and `hints`, the unsupported model types nearest to it with what their config does not show.
SUPPORTED_ARCHITECTURES, FAMILIES, KNOWN and every comparison below are derived from the table. Adding a
family the decoder already computes is one declaration here plus its parity test
(tests/test_model_families.py).

`nearest_family(cfg)` compares a Hugging Face `config.json` of an architecture we do not build with the table:
config keys (activation, norm, soft-capping, experts (nearest then a mixture-of-experts family), latent
attention, rotary, multipliers, ...) plus, for a few well-known model types, what their config does not say
(Gemma's (1+w) RMSNorm, fused projection weights, ...). The dry run and the build print it when they refuse a
checkpoint, so the message says how far the checkpoint is from one we build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# the RoPE scaling types the model definition computes (compiler/checkpoint.py refuses others)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

Config = Mapping[str, Any]  # a config.json
# (config.json, the facts every family reads alike: hidden_size, head_dim, num_layers) -> a flag's value
Derive = Callable[[Config, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Fact:
    """A default taken from the facts every family reads alike (e.g. head_dim)."""

    name: str


@dataclass(frozen=True)
class Read:
    """A flag read from config.json: the value of the first of `keys` that is set (present and not null,
    false, 0 or empty), else `default` (a `Fact` names a common fact); `convert` is applied to whichever is
    not None. Without a default a key must be there (KeyError, as `config[key]`)."""

    keys: str | tuple[str, ...]
    default: Any = KeyError
    convert: Callable[[Any], Any] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.keys,) if isinstance(self.keys, str) else self.keys

    def __call__(self, cfg: Config, facts: Mapping[str, Any] | None = None) -> Any:
        value = next((cfg[k] for k in self.names if cfg.get(k)), None)
        if value is None:
            if self.default is KeyError:
                value = cfg[self.names[0]]
            elif isinstance(self.default, Fact):
                value = (facts or {})[self.default.name]
            else:
                value = self.default
        return value if value is None or self.convert is None else self.convert(value)


@dataclass(frozen=True)
class Resembles:
    """What makes a config of an unknown model type nearest to a family: `test(config)`; the families are
    asked in `rank` order (lowest first), the first that says yes is the nearest."""

    rank: int
    test: Callable[[Config], bool]


@dataclass(frozen=True, eq=False)
class Family:
    """One family of the decoder: its names, how config.json sets the decoder's flags, what it refuses, and
    what is nearest to it (see the module docstring)."""

    model_type: str
    architectures: tuple[str, ...]
    # ModelConfig field -> constant | Read | Derive; the fields it does not name are read as COMMON_READS says
    reads: Mapping[str, Any] = field(default_factory=dict)
    # each: (architecture, config.json) -> the message that refuses it, or None
    refusals: tuple[Callable[[str, Config], str | None], ...] = ()
    moe: str | None = None  # model_type of the mixture-of-experts family of its attention
    resembles: Resembles | None = None
    # unsupported model_type -> the differences its config does not show (this family is its nearest)
    hints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def flags(self, cfg: Config, facts: Mapping[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields this family sets, read from `cfg` (after its refusals passed)."""
        out: dict[str, Any] = {}
        for name, how in {**COMMON_READS, **self.reads}.items():
            out[name] = how(cfg, facts) if callable(how) else how
        return out

    def refusal(self, arch: str, cfg: Config) -> str | None:
        """The message of the first refusal `cfg` meets, or None."""
        return next((m for r in self.refusals if (m := r(arch, cfg)) is not None), None)

    def reads_key(self, key: str) -> bool:
        """Whether one of its `Read`s takes config key `key` (the config asks for nothing it lacks there)."""
        return any(isinstance(how, Read) and key in how.names for how in self.reads.values())

    def sets(self, flag: str) -> bool:
        """Whether it sets `flag` (a ModelConfig field) to something else than the common reading's false."""
        return flag in self.reads and self.reads[flag] is not False


# -- how the flags are read --------------------------------------------------------------------------------

def no_windows(cfg: Config, facts: Mapping[str, Any]) -> tuple[int | None, ...]:
    return (None,) * facts["num_layers"]


def window_on_every_layer(cfg: Config, facts: Mapping[str, Any]) -> tuple[int | None, ...]:
    """`sliding_window` on every layer (none when unset)."""
    window = cfg.get("sliding_window")
    return (int(window) if window else None,) * facts["num_layers"]


def windows_by_layer_type(every: int | Read) -> Derive:
    """`sliding_window` on the layers `layer_types` calls sliding_attention, else transformers' default
    pattern: every `every`-th layer full, the others sliding."""
    def windows(cfg: Config, facts: Mapping[str, Any]) -> tuple[int | None, ...]:
        window, layers = cfg.get("sliding_window"), facts["num_layers"]
        n = every(cfg, facts) if isinstance(every, Read) else every
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % n else "full_attention"
                                           for i in range(layers)]
        return tuple(int(window) if window and t == "sliding_attention" else None for t in types)
    return windows


def windows_past_max_window_layers(cfg: Config, facts: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Qwen's: with `use_sliding_window`, the layers `layer_types` calls sliding_attention, else those from
    `max_window_layers` on."""
    window, layers = cfg.get("sliding_window"), facts["num_layers"]
    if not cfg.get("use_sliding_window", False) or not window:
        return (None,) * layers
    types = cfg.get("layer_types")
    if not types:
        max_window_layers = int(cfg.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= max_window_layers else "full_attention" for i in range(layers)]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def every_layer_sparse(cfg: Config, facts: Mapping[str, Any]) -> tuple[bool, ...]:
    return (True,) * facts["num_layers"]


def sparse_every_step(cfg: Config, facts: Mapping[str, Any]) -> tuple[bool, ...]:
    """Qwen-MoE's: layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers are sparse."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(facts["num_layers"]))


EXPERTS = Read(("num_local_experts", "num_experts"), 0, int)
EXPERTS_PER_TOKEN = Read("num_experts_per_tok", 0, int)


def experts_refusal(arch: str, cfg: Config) -> str | None:
    experts, top_k = EXPERTS(cfg), EXPERTS_PER_TOKEN(cfg)
    if experts < 1 or not 1 <= top_k <= experts:
        return (f"{arch}: needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts "
                f"(got {experts} experts, {top_k} per token)")
    return None


# every family, unless its declaration says otherwise
COMMON_READS: dict[str, Any] = {
    "qkv_bias": Read("attention_bias", False, bool),
    "o_bias": Read("attention_bias", False, bool),
    "mlp_bias": Read("mlp_bias", False, bool),
    "qk_norm": False,
    "sliding_windows": no_windows,
}
# Qwen2's bias on q/k/v (always), none on o
_QKV_BIAS = {"qkv_bias": True, "o_bias": False}
# Gemma 2 and 3: scaled embeddings, (1+w) RMSNorm, norms before and after both branches, the softmax scale
# query_pre_attn_scalar^-0.5, tanh soft-capping of the attention scores and the logits
_GEMMA: dict[str, Any] = {
    "embedding_multiplier": lambda cfg, facts: float(facts["hidden_size"]) ** 0.5,
    "norm_weight_offset": 1.0,
    "sandwich_norm": True,
    "attention_multiplier": Read("query_pre_attn_scalar", Fact("head_dim"), lambda v: float(v) ** -0.5),
    "attn_logit_softcapping": Read("attn_logit_softcapping", None, float),
    "final_logit_softcapping": Read("final_logit_softcapping", None, float),
}
# Qwen2-MoE / Qwen3-MoE: experts of moe_intermediate_size, renormalised when norm_topk_prob
_QWEN_EXPERTS: dict[str, Any] = {
    "num_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "norm_topk_prob": Read("norm_topk_prob", False, bool),
    "moe_intermediate_size": Read("moe_intermediate_size", convert=int),
    "moe_layers": sparse_every_step,
}
_NON_GATED = "a non-gated MLP (fc in -> activation -> fc out; ours: gate_proj/up_proj/down_proj)"


def _qk_norm_key(cfg: Config) -> bool:
    return bool(cfg.get("qk_norm") or cfg.get("use_qk_norm") or cfg.get("qk_layernorm"))


# -- the families (their order is the order of the supported list in messages) ------------------------------

FAMILY_TABLE: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), moe="mixtral",
           resembles=Resembles(99, lambda cfg: True),  # the default
           hints={
               "phi": (_NON_GATED, "a bias on every projection"),
               "cohere": ("attention and MLP in parallel on one residual (ours: one after the other)",),
               "gpt2": ("learned absolute position embeddings (ours: RoPE)", _NON_GATED,
                        "fused c_attn Conv1D weights"),
               "gpt_neox": (_NON_GATED, "fused query_key_value weights"),
               "falcon": (_NON_GATED, "fused query_key_value weights"),
               "stablelm": (),
               "deepseek_v2": (),
               "deepseek_v3": (),
           }),
    Family("mistral", ("MistralForCausalLM",), {"sliding_windows": window_on_every_layer}, moe="mixtral",
           resembles=Resembles(3, lambda cfg: bool(cfg.get("sliding_window") and not cfg.get("layer_types"))),
           hints={"starcoder2": (_NON_GATED, "a bias on every projection")}),
    Family("qwen2", ("Qwen2ForCausalLM",), {**_QKV_BIAS, "sliding_windows": windows_past_max_window_layers},
           moe="qwen2_moe",
           resembles=Resembles(2, lambda cfg: bool(cfg.get("use_qkv_bias") or cfg.get("qkv_bias")))),
    Family("qwen3", ("Qwen3ForCausalLM",),
           {"qk_norm": True, "sliding_windows": windows_past_max_window_layers},
           moe="qwen3_moe", resembles=Resembles(1, _qk_norm_key)),
    # Granite 3: the embeddings and each residual branch multiplied, attention_multiplier the softmax scale,
    # the logits divided by logits_scaling
    Family("granite", ("GraniteForCausalLM",), {
        "embedding_multiplier": Read("embedding_multiplier", 1.0, float),
        "residual_multiplier": Read("residual_multiplier", 1.0, float),
        "attention_multiplier": Read("attention_multiplier", 1.0, float),
        "logits_scaling": Read("logits_scaling", 1.0, float),
    }),
    # Phi-3: q/k/v stored as one qkv_proj, gate/up as one gate_up_proj
    Family("phi3", ("Phi3ForCausalLM",), {"fused_weights": True, "sliding_windows": window_on_every_layer}),
    # OLMo 2: RMSNorm on the branches' outputs (no input norms), q/k RMSNorm over the whole projection
    Family("olmo2", ("Olmo2ForCausalLM",), {"qk_norm": True, "qk_norm_full": True, "post_norm": True}),
    Family("gemma2", ("Gemma2ForCausalLM",), {**_GEMMA, "sliding_windows": windows_by_layer_type(2)},
           hints={"gemma": ("RMSNorm before each branch only (gemma2: before and after)",)}),
    # Gemma 3 (text): Gemma 2's layout with per-head q/k RMSNorm (its local RoPE: compiler/checkpoint.py)
    Family("gemma3_text", ("Gemma3ForCausalLM",), {
        **_GEMMA, "qk_norm": True,
        "sliding_windows": windows_by_layer_type(Read("sliding_window_pattern", 6, int)),
    }),
    # Mixtral: every layer sparse, experts of intermediate_size, the top-k weights renormalised
    Family("mixtral", ("MixtralForCausalLM",), {
        "sliding_windows": window_on_every_layer,
        "num_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "norm_topk_prob": True,
        "moe_intermediate_size": Read("intermediate_size", convert=int), "moe_layers": every_layer_sparse,
    }, refusals=(experts_refusal,)),
    # Qwen2-MoE: also a shared expert (a gated MLP behind a sigmoid gate) on every token
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), {
        **_QKV_BIAS, "sliding_windows": windows_past_max_window_layers, **_QWEN_EXPERTS,
        "shared_expert_intermediate_size": Read("shared_expert_intermediate_size", 0, int),
    }, refusals=(experts_refusal,)),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), {
        "qk_norm": True, "sliding_windows": windows_past_max_window_layers, **_QWEN_EXPERTS,
    }, refusals=(experts_refusal,)),
    # InternLM 3: transformers builds model_type internlm3 with LlamaForCausalLM, config.json's qkv_bias as its
    # attention_bias (q/k/v/o) and bias as its mlp_bias, and refuses the two unequal
    Family("internlm3", ("InternLM3ForCausalLM",), {
        "qkv_bias": Read(("qkv_bias", "attention_bias"), False, bool),
        "o_bias": Read(("qkv_bias", "attention_bias"), False, bool),
        "mlp_bias": Read(("bias", "mlp_bias"), False, bool),
    }, refusals=(
        lambda arch, cfg: None if (qkv := bool(cfg.get("qkv_bias") or cfg.get("attention_bias")))
        == (bias := bool(cfg.get("bias") or cfg.get("mlp_bias")))
        else f"{arch}: qkv_bias {qkv} and bias {bias} differ (transformers builds it as Llama and refuses them unequal)",
    )),
)

# derived from the table
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILY_TABLE for a in f.architectures)
FAMILY_OF_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILY_TABLE for a in f.architectures}
FAMILY_OF_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILY_TABLE}
# model_type of each supported family -> its architecture name
FAMILIES: dict[str, str] = {f.model_type: f.architectures[0] for f in FAMILY_TABLE}
# (what an unknown config shows, the family it then is nearest to), in the order they are asked
RESEMBLANCES: list[tuple[Resembles, str]] = sorted(
    ((f.resembles, f.model_type) for f in FAMILY_TABLE if f.resembles is not None), key=lambda r: r[0].rank)
# model_type -> (nearest family, differences its config keys do not show)
KNOWN: dict[str, tuple[str, list[str]]] = {
    t: (f.model_type, list(d)) for f in FAMILY_TABLE for t, d in f.hints.items()}


def family_of(architecture: str) -> Family | None:
    """The family that builds `architecture` (config.json's architectures[0]), or None."""
    return FAMILY_OF_ARCHITECTURE.get(architecture)


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


def _num(cfg: Config, *keys: str) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) not in (None, False, 0)), None)


def _rope(cfg: Config) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = next(iter(rope.values()))  # per layer type (Gemma 3): the first is enough here
    return rope if isinstance(rope, dict) else {}


def config_differences(cfg: Config, gated: bool = True, family: str = "llama") -> list[str]:
    """What `cfg` asks for that `family` (a model_type of FAMILY_TABLE) does not do, from its config keys
    (`gated`: whether its MLP is gated like ours, which the config does not say)."""
    fam = FAMILY_OF_TYPE[family]
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
        if cfg.get(key) and not fam.reads_key(key):
            out.append(f"{what} ({key}={cfg[key]})")
    if cfg.get("query_pre_attn_scalar") and not fam.reads_key("query_pre_attn_scalar"):
        out.append(f"attention scale 1/sqrt(query_pre_attn_scalar={cfg['query_pre_attn_scalar']}) "
                   "(ours: 1/sqrt(head_dim))")
    experts = _num(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    if experts and not fam.sets("num_experts"):
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
    if (cfg.get("qk_layernorm") or cfg.get("use_qk_norm")) and not fam.sets("qk_norm"):
        out.append("q/k LayerNorm")
    return out


def nearest_family(cfg: Config) -> Nearest:
    """The supported family closest to `cfg` (a config.json of an architecture we do not build)."""
    model_type = str(cfg.get("model_type") or "")
    known = KNOWN.get(model_type)
    extra: list[str] = []
    if known is not None:
        family, extra = known[0], list(known[1])
    elif (prefix := next((f for f in FAMILIES if model_type.startswith(f)), None)) is not None:
        family = prefix  # qwen2_vl, mistral3, llama4_text, ...
    else:  # the first family, by rank, whose signs the config shows
        family = next(t for r, t in RESEMBLANCES if r.test(cfg))
    moe = FAMILY_OF_TYPE[family].moe
    if _num(cfg, "num_local_experts", "num_experts", "n_routed_experts") and moe is not None:
        family = moe
    differences = config_differences(cfg, gated=_NON_GATED not in extra, family=family)
    return Nearest(family, FAMILIES[family], tuple(differences + extra))


__all__ = ["COMMON_READS", "FAMILIES", "FAMILY_TABLE", "KNOWN", "RESEMBLANCES", "ROPE_TYPES",
           "SUPPORTED_ARCHITECTURES", "Fact", "Family", "Nearest", "Read", "Resembles", "config_differences",
           "family_of", "nearest_family"]
