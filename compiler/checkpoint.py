"""Read a local Hugging Face checkpoint: config, (sharded) safetensors weights, tokenizer files.

`inspect_checkpoint` reads only `config.json` and the safetensors headers (no weights), so a
dry run can check the source in milliseconds; it also checks that every tensor lies inside its shard
(a truncated shard is named with its first tensor past the end). `lazy_weights` reads one tensor at
a time when it is asked for (positioned reads, no memory map: a build holds one tensor of the
checkpoint at a time); `load_weights` reads them all. `source_sha256`
hashes the config and every weight file for the manifest's provenance. The EOS ids are those of
`generation_config.json` where it sets them (what transformers' `generate` stops on), else config.json's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from compiler.models.families import ROPE_TYPES, SUPPORTED_ARCHITECTURES, family_of, nearest_family

log = logging.getLogger(__name__)

# The families and their architectures (SUPPORTED_ARCHITECTURES): compiler/models/families.py FAMILY_TABLE,
# one declaration each; ModelConfig.from_hf reads a config through its family's.
# RoPE types of rope_parameters / rope_scaling the model definition computes as transformers does
# (compiler/models/llama.py rope_inv_freq): ROPE_TYPES (compiler/models/families.py); `dynamic` equals `default`
# up to max_position_embeddings, where max_model_len is capped
# MLP activations of hidden_act / hidden_activation -> the model definition's name
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(Exception):
    """The checkpoint folder is missing something or holds something we cannot build."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts our model definition needs, normalised across the families."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Granite's multipliers (1 / None elsewhere): the embeddings, each residual branch, the attention's
    # softmax scale (in place of 1/sqrt(head_dim)) and the logits (divided)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    rotary_dim: int = 0  # dimensions of a head that RoPE turns (partial_rotary_factor * head_dim); 0: all
    # OLMo 2: RMSNorm on the attention's and the MLP's outputs before the residual adds (no input norms),
    # and its q/k RMSNorm over the whole projection rather than per head
    post_norm: bool = False
    qk_norm_full: bool = False
    # Gemma 2: GeGLU (gelu, tanh approximation), RMSNorm weights stored as w - 1 (the loader adds the 1), norms
    # before and after both branches ("sandwich"), tanh soft-capping of the attention scores and the logits
    mlp_activation: str = "silu"  # silu | gelu_tanh
    # Gemma 3: the sliding-window layers' own RoPE (theta and scaling); None: every layer uses the above
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    norm_weight_offset: float = 0.0
    sandwich_norm: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the sparse layers' routed experts (gated MLPs of
    # moe_intermediate_size), top-k of a softmax router, the k weights renormalised or not; Qwen2-MoE's
    # shared expert (a gated MLP behind a sigmoid gate) added to every token. Dense layers keep `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: a sparse MoE block (else the dense MLP)
    # Phi-3: q/k/v stored as one qkv_proj and gate/up as one gate_up_proj (the loader splits them)
    fused_weights: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None,
                max_model_len: int | None = None) -> ModelConfig:
        """From config.json (`cfg`) and, where the checkpoint has one, generation_config.json
        (`generation`): its eos_token_id, when set, is what transformers' generate stops on.
        `max_model_len` (the recipe's) picks LongRoPE's factor set (see _longrope_factors). The fields every
        family reads alike are read here; the family's declaration (compiler/models/families.py) reads the
        rest and says what it refuses."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else "<none>"
        family = family_of(arch)
        if family is None:
            model_type = cfg.get("model_type") or "this checkpoint"
            raise CheckpointError(
                f"architecture {arch!r} (model_type {model_type}) is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}\n{nearest_family(cfg).describe(str(model_type))}"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise CheckpointError(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        local: tuple[float, dict[str, Any] | None] | None = None
        if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3)
            if "sliding_attention" in rope:
                local = _rope_spec(dict(rope["sliding_attention"]), cfg, head_dim, max_model_len)[:2]
            rope = dict(rope.get("full_attention") or {})
        elif cfg.get("rope_local_base_freq"):  # Gemma 3 configs written before per-layer-type parameters
            local = (float(cfg["rope_local_base_freq"]), None)
        theta, rope_scaling, rotary_dim = _rope_spec(rope, cfg, head_dim, max_model_len)
        layers = int(cfg["num_hidden_layers"])
        eos = (generation or {}).get("eos_token_id")
        if eos is None:
            eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        intermediate = int(cfg["intermediate_size"])
        refusal = family.refusal(arch, cfg)
        if refusal is not None:
            raise CheckpointError(refusal)
        facts = {"hidden_size": hidden, "head_dim": head_dim, "num_layers": layers, "intermediate_size": intermediate}
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rotary_dim=rotary_dim,
            local_rope_theta=local[0] if local else None,
            local_rope_scaling=local[1] if local else None,
            mlp_activation=ACTIVATIONS[act],
            **family.flags(cfg, facts),
        )

    def to_dict(self) -> dict[str, Any]:
        """The model the artifact computes (the manifest's source.config); `fused_weights` is how the checkpoint
        stores its weights, which the loader splits, so an artifact has no such layout to describe."""
        d = asdict(self)
        del d["fused_weights"]
        d["sliding_windows"] = list(self.sliding_windows)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["moe_layers"] = list(self.moe_layers)
        return d


def _rope_spec(rope: dict[str, Any], cfg: dict[str, Any], head_dim: int, max_model_len: int | None
               ) -> tuple[float, dict[str, Any] | None, int]:
    """(theta, scaling parameters or None for the default type, rotated dimensions) of one RoPE setting."""
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"RoPE type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise CheckpointError(f"partial_rotary_factor {partial} gives {rotary_dim} rotated dimensions of "
                              f"{head_dim}: must be even and positive")
    rope_scaling = None if rope_type == "default" else {
        k: v for k, v in sorted(rope.items()) if k not in ("rope_theta", "partial_rotary_factor")
    }
    if rope_type == "longrope":
        rope_scaling = _longrope_factors(rope_scaling or {}, cfg, head_dim, rotary_dim, max_model_len)
    return theta, rope_scaling, rotary_dim


def _longrope_factors(sc: dict[str, Any], cfg: dict[str, Any], head_dim: int, rotary_dim: int,
                      max_model_len: int | None) -> dict[str, Any]:
    """LongRoPE (Phi-3.5, Phi-4-mini): transformers turns positions with `short_factor` while a forward's
    longest sequence is within original_max_position_embeddings and with `long_factor` beyond, switching
    per forward (keys cached before the switch keep the short rotation). A paged cache needs one rotation
    per artifact: the short factors when max_model_len stays within the original context (then every
    result equals transformers'), the long ones when it goes beyond (transformers' rotation for any
    forward past the original length). The choice is written into the config as `factors`."""
    original = sc.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise CheckpointError("longrope needs original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        if len(sc.get(key) or []) != rotary_dim // 2:
            raise CheckpointError(f"longrope {key} must have rotary_dim / 2 = {rotary_dim // 2} entries "
                                  f"(head_dim {head_dim})")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    context = min(max_model_len, max_pos) if max_model_len else None
    factors = "long" if context is not None and context > int(original) else "short"
    return {**sc, "original_max_position_embeddings": int(original), "factors": factors}


@dataclass(frozen=True)
class CheckpointInfo:
    """What a dry run learns from a checkpoint without reading any weight."""

    path: Path
    config: ModelConfig
    weight_files: tuple[Path, ...]
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(repr=False)  # name -> (dtype, shape)
    tokenizer_files: tuple[Path, ...] = ()
    # name -> (shard, first byte, end byte) in the file
    locations: dict[str, tuple[Path, int, int]] = field(default_factory=dict, repr=False)

    @property
    def num_parameters(self) -> int:
        total = 0
        for _, shape in self.tensors.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def weight_bytes(self) -> int:
        total = 0
        for dtype, shape in self.tensors.values():
            n = _DTYPE_BYTES.get(dtype, 4)
            for d in shape:
                n *= d
            total += n
        return total


def read_generation_config(path: Path) -> dict[str, Any] | None:
    """generation_config.json of the checkpoint folder, or None when it has none."""
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return None
    try:
        data = json.loads(gen_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{gen_path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{gen_path}: must hold a JSON object")
    return data


def read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} is missing: not a Hugging Face checkpoint folder")
    try:
        return json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e


def weight_files(path: Path) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        names = sorted(set(data.get("weight_map", {}).values()))
        files = tuple(path / n for n in names)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    if single.is_file():
        return (single,)
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(
            f"{path} has only pickle weights (*.bin/*.pt); only safetensors are loaded (nothing is unpickled)"
        )
    raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")


def _safetensors_header(file: Path) -> dict[str, Any]:
    """The header's tensor entries, each with "_start" / "_end": the data's absolute byte range in `file`."""
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: truncated safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise CheckpointError(f"{file}: implausible safetensors header size {n}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    size = file.stat().st_size
    for name, meta in header.items():
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            dtype, shape = meta["dtype"], [int(d) for d in meta["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: tensor {name!r}: corrupt header entry ({e})") from e
        nbytes = _DTYPE_BYTES.get(dtype, 0)
        for d in shape:
            nbytes *= d
        if dtype in _DTYPE_BYTES and end - begin != nbytes:
            raise CheckpointError(f"{file}: tensor {name!r}: {end - begin} bytes stored for {dtype} {shape} "
                                  f"({nbytes} expected): corrupt header")
        if 8 + n + end > size:
            raise CheckpointError(f"{file}: truncated: tensor {name!r} ends at byte {8 + n + end}, the file has "
                                  f"{size} bytes")
        meta["_start"], meta["_end"] = 8 + n + begin, 8 + n + end
    return header


def inspect_checkpoint(path: str | Path, max_model_len: int | None = None) -> CheckpointInfo:
    """Config + tensor names/shapes from the safetensors headers; reads no weight data."""
    path = Path(path).resolve()
    config = ModelConfig.from_hf(read_config(path), read_generation_config(path), max_model_len)
    files = weight_files(path)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    locations: dict[str, tuple[Path, int, int]] = {}
    for f in files:
        for name, meta in _safetensors_header(f).items():
            tensors[name] = (meta["dtype"], tuple(meta["shape"]))
            locations[name] = (f, meta["_start"], meta["_end"])
    if "model.embed_tokens.weight" not in tensors:
        raise CheckpointError(f"{path}: no tensor 'model.embed_tokens.weight'; not a supported layout")
    tok = tuple(path / n for n in TOKENIZER_FILES if (path / n).is_file())
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}/tokenizer.json is missing (a fast tokenizer file is required)")
    return CheckpointInfo(path=path, config=config, weight_files=files, tensors=tensors, tokenizer_files=tok,
                          locations=locations)


class LazyWeights(Mapping[str, Any]):
    """The checkpoint's tensors by name, each read from its shard when asked for (a new torch tensor in its
    stored dtype; nothing is cached): a model loads one tensor at a time."""

    def __init__(self, info: CheckpointInfo) -> None:
        self.info = info

    def __getitem__(self, name: str) -> Any:
        import torch

        dtype, shape = self.info.tensors[name]
        file, begin, end = self.info.locations[name]
        tdtype = _TORCH_DTYPES.get(dtype)
        if tdtype is None:
            raise CheckpointError(f"{file}: tensor {name!r}: dtype {dtype} is not supported")
        buf = bytearray(end - begin)
        try:
            with file.open("rb") as f:
                f.seek(begin)
                got = f.readinto(buf)
        except OSError as e:
            raise CheckpointError(f"{file}: tensor {name!r}: cannot read ({e})") from e
        if got != len(buf):  # shortened since inspect_checkpoint looked
            raise CheckpointError(f"{file}: truncated: tensor {name!r} needs bytes {begin}..{end}, read {got}")
        if not buf:
            return torch.empty(shape, dtype=getattr(torch, tdtype))
        return torch.frombuffer(buf, dtype=getattr(torch, tdtype)).reshape(shape)

    def rows(self, name: str, start: int, stop: int) -> Any:
        """Rows start..stop of a tensor (its first dimension), read alone from its shard."""
        import torch

        dtype, shape = self.info.tensors[name]
        file, begin, end = self.info.locations[name]
        tdtype = _TORCH_DTYPES.get(dtype)
        if tdtype is None:
            raise CheckpointError(f"{file}: tensor {name!r}: dtype {dtype} is not supported")
        row_bytes = (end - begin) // shape[0] if shape and shape[0] else 0
        buf = bytearray(row_bytes * (stop - start))
        try:
            with file.open("rb") as f:
                f.seek(begin + start * row_bytes)
                got = f.readinto(buf)
        except OSError as e:
            raise CheckpointError(f"{file}: tensor {name!r}: cannot read ({e})") from e
        if got != len(buf):  # shortened since inspect_checkpoint looked
            raise CheckpointError(f"{file}: truncated: tensor {name!r} needs bytes {begin + start * row_bytes}.."
                                  f"{begin + stop * row_bytes}, read {got}")
        if not buf:
            return torch.empty((stop - start, *shape[1:]), dtype=getattr(torch, tdtype))
        return torch.frombuffer(buf, dtype=getattr(torch, tdtype)).reshape((stop - start, *shape[1:]))

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the shard header (nothing read)."""
        return tuple(self.info.tensors[name][1])

    def __iter__(self) -> Iterator[str]:
        return iter(self.info.tensors)

    def __contains__(self, name: object) -> bool:  # Mapping's default reads the tensor to find out
        return name in self.info.tensors

    def __len__(self) -> int:
        return len(self.info.tensors)


_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                 "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def lazy_weights(info: CheckpointInfo) -> LazyWeights:
    """The tensors read on demand (LazyWeights), in the order of the checkpoint's headers."""
    return LazyWeights(info)


def load_weights(info: CheckpointInfo) -> dict[str, Any]:
    """All tensors as torch tensors (their stored dtype), from every shard."""
    weights = lazy_weights(info)
    return {name: weights[name] for name in weights}


class HashStopped(Exception):
    """source_sha256 was told to stop (the build it hashed for has ended)."""


def source_sha256(info: CheckpointInfo, stop: threading.Event | None = None) -> str:
    """sha256 over config.json and each weight file (by name, in sorted order). `stop`: checked between reads of
    8 MiB; once set, HashStopped is raised. The reads and the hashing release the GIL; one buffer, reused, and
    few large reads, so that a build's main thread rarely hands the GIL over to this one."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(8 << 20))
    for f in [info.path / "config.json", *sorted(info.weight_files)]:
        h.update(f.name.encode() + b"\0")
        with f.open("rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                if stop is not None and stop.is_set():
                    raise HashStopped(str(f))
                h.update(buf[:n])
    return h.hexdigest()
