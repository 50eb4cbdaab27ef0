"""Calibration data and a layer-by-layer runner of our model definition.

Selection (recorded in the manifest): the file's text (a .jsonl file: its records' `text_field`
joined by a blank line) is tokenized without special tokens and cut into consecutive
non-overlapping windows of `seq_len` tokens (the partial tail dropped); `num_samples` windows are
drawn without replacement by `numpy.random.default_rng(seed)` and kept in file order. The budget,
num_samples x seq_len tokens, defaults to 128 windows (compiler.recipe.DEFAULT_CALIBRATION_SAMPLES),
or every window when the file has fewer; a budget the recipe sets and the file cannot fill is an
error. The manifest's `budget` says which, with the share of the file's windows used.

`LayerRunner` pushes the samples through the decoder one layer at a time (each sample a sequence
of its own, no past), so peak memory is the model plus one layer's activations over the calibration
tokens; hooks on a layer's Linear modules capture what each sees. The embedding, the rotation and
the layer's residual wiring are the model's own (`embed`, `rope_cos_sin`, `layer_forward`). Where no
layer has a sliding window or soft-capped scores, attention runs as dense causal attention over
[sequences, heads, seq_len, head_dim] (`dense_attention`: the layer's own `Attention.project` and
o_proj, torch's scaled_dot_product_attention in float32 between them), the same function as the
model's paged ForwardBatch attention on sequences without past, several times faster on the
calibration batches (16 sequences per batch); otherwise the model's own attention runs. It runs the layers in the model's dtype (FP8 activation scales of a
float16 target are measured on float16 activations); the INT4 searches (AWQ, GPTQ) run inside
`float32_search`, in float32 on the target's (rounded) weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from compiler.context import BuildError
from compiler.recipe import DEFAULT_CALIBRATION_SAMPLES

if TYPE_CHECKING:  # pragma: no cover
    from compiler.context import BuildContext


@contextmanager
def float32_search(model: Any, deferred: dict[str, Any] | None = None) -> Iterator[None]:
    """The model in float32 for the duration (a float16/bfloat16 target's weights, upcast exactly), then
    back to its dtype: AWQ's scale search and GPTQ's updates compare and accumulate in float32, and
    the weights they write are rounded to the target dtype once, at the end. The streamed parameters
    (`deferred`: capture's deferred_params) are not cast, which would read them: each gets an unwritten float32
    storage for the duration (state.parameters_read upcasts what it reads into it), then its own back."""
    dtype = model.embed_tokens.weight.dtype
    if dtype == torch.float32:
        yield
        return
    unread = {name: model.get_parameter(name) for name in deferred or {}}
    kept = {name: p.data for name, p in unread.items()}
    for p in unread.values():
        p.data = torch.empty(p.shape, dtype=torch.float32)
    model.cast(torch.float32)
    try:
        yield
    finally:
        for name, p in unread.items():
            p.data = kept[name]
        model.cast(dtype)


@dataclass(frozen=True)
class Calibration:
    samples: tuple[tuple[int, ...], ...]  # token ids, each seq_len long
    record: dict[str, Any]  # what the manifest says about the selection


def read_text(path: Path, text_field: str) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BuildError(f"calibration data {path} is not UTF-8 text: {e}") from e
    if path.suffix.lower() != ".jsonl":
        return text
    parts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BuildError(f"{path}:{n}: invalid JSON ({e.msg})") from e
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise BuildError(f"{path}:{n}: no string field {text_field!r} (calibration.text_field)")
        parts.append(value)
    return "\n\n".join(parts)


def select_windows(num_tokens: int, seq_len: int, num_samples: int, seed: int) -> list[int]:
    """Start offsets of the chosen windows, ascending."""
    windows = num_tokens // seq_len
    if windows < num_samples:
        raise BuildError(f"calibration data has {num_tokens} tokens = {windows} windows of {seq_len}; "
                         f"num_samples is {num_samples} (lower it, shorten seq_len or give more text)")
    picked = np.sort(np.random.default_rng(seed).choice(windows, size=num_samples, replace=False))
    return [int(i) * seq_len for i in picked]


def load_calibration(ctx: BuildContext, by: str) -> Calibration:
    """The recipe's calibration windows (tokenized once per build, shared by the passes)."""
    cached = ctx.artifacts.get("calibration")
    if cached is not None:
        return cached
    spec = ctx.recipe.calibration
    if spec is None:
        raise BuildError(f"pass {by!r} needs calibration data: add a 'calibration:' section to the recipe "
                         "(data: a local .txt or .jsonl file; num_samples, seq_len, seed)")
    text = read_text(spec.data, spec.text_field)
    tok = Tokenizer.from_file(str(ctx.checkpoint.path / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    windows = len(ids) // spec.seq_len
    if spec.num_samples is not None:
        num_samples, set_by = spec.num_samples, "recipe (calibration.num_samples)"
    else:
        num_samples = min(DEFAULT_CALIBRATION_SAMPLES, windows)
        set_by = (f"default ({DEFAULT_CALIBRATION_SAMPLES} windows)" if windows >= DEFAULT_CALIBRATION_SAMPLES
                  else f"default: every window of the file (fewer than {DEFAULT_CALIBRATION_SAMPLES})")
        if num_samples < 1:
            raise BuildError(f"calibration data has {len(ids)} tokens, fewer than one window of {spec.seq_len}")
    starts = select_windows(len(ids), spec.seq_len, num_samples, spec.seed)
    samples = tuple(tuple(ids[s:s + spec.seq_len]) for s in starts)
    written = ctx.recipe.as_dict().get("calibration", {}).get("data", spec.data.name)
    record = {
        "data": written,
        "sha256": hashlib.sha256(spec.data.read_bytes()).hexdigest(),
        "format": "jsonl" if spec.data.suffix.lower() == ".jsonl" else "text",
        "tokens": len(ids),
        "seq_len": spec.seq_len,
        "num_samples": num_samples,
        "seed": spec.seed,
        "budget": {"tokens": num_samples * spec.seq_len, "set_by": set_by, "windows_available": windows,
                   "windows_used_fraction": round(num_samples / windows, 4)},
        "selection": "numpy.random.default_rng(seed).choice(windows, num_samples, replace=False), sorted",
        "window_starts": starts,
    }
    cal = Calibration(samples, record)
    ctx.artifacts["calibration"] = cal
    return cal


@dataclass
class _Batch:
    """Packed calibration sequences of one forward (no past) and the per-step tensors of every layer."""

    cos: torch.Tensor
    sin: torch.Tensor
    actx: Any  # compiler.models.llama.AttentionContext
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cos_local: torch.Tensor  # the sliding-window layers' rotation (Gemma 3); the same as cos elsewhere
    sin_local: torch.Tensor
    seq_len: int | None = None  # every sequence this long: the dense attention path applies


def dense_attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_len: int
                    ) -> torch.Tensor:
    """Causal self-attention of packed sequences of `seq_len` tokens without past (x [B * seq_len, hidden]):
    the model's own projections, q/k norms and rotation (Attention.project) and o_proj, with the scores
    in one batched kernel instead of the paged gather (no window, no soft-capping: LayerRunner checks)."""
    t = x.shape[0]
    b = t // seq_len
    q, k, v = attn.project(x, cos, sin)
    group = attn.h // attn.kvh

    def heads(z: torch.Tensor, n: int) -> torch.Tensor:  # [T, n, d] -> [B, n, L, d] in float32
        return z.view(b, seq_len, n, attn.d).transpose(1, 2).to(torch.float32)

    kh = heads(k, attn.kvh).repeat_interleave(group, dim=1)  # query head i reads KV head i // group
    vh = heads(v, attn.kvh).repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(heads(q, attn.h), kh, vh, is_causal=True,
                                                           scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(t, attn.h * attn.d).to(x.dtype))


class _InputsSeen(Exception):
    """Raised inside a layer's forward once LayerRunner.capture has every input it asked for."""


@dataclass
class _Kept:
    """What LayerRunner keeps of one layer's forwards while the layer's later parts change: per batch, the
    attention's output once its weights are final, and the MLP's down projection input once the projections
    before it are final (None: not computed yet; `mlp_input` None: not kept)."""

    layer: nn.Module
    attention: list[torch.Tensor | None]
    mlp_input: list[torch.Tensor | None] | None = None


class LayerRunner:
    """Runs the calibration samples through `model` one decoder layer at a time."""

    def __init__(self, model: nn.Module, samples: Iterable[Iterable[int]], max_tokens_per_batch: int | None = None
                 ) -> None:
        from compiler.models.llama import AttentionContext

        self.model = model
        cfg = model.cfg
        seqs = [list(s) for s in samples]
        # dense attention where every layer attends to its whole causal past with plain softmax scores
        self.dense = all(w is None for w in cfg.sliding_windows) and not cfg.attn_logit_softcapping
        if max_tokens_per_batch is None:  # the paged path's scores grow with the batch's tokens squared
            max_tokens_per_batch = 4096 if self.dense else 256
        groups: list[list[list[int]]] = []
        for s in seqs:
            if groups and sum(map(len, groups[-1])) + len(s) <= max_tokens_per_batch:
                groups[-1].append(s)
            else:
                groups.append([s])
        self.batches: list[_Batch] = []
        self.hidden: list[torch.Tensor] = []  # input of the next layer, one [T, hidden] per batch
        dtype = model.embed_tokens.weight.dtype  # the model's (a float16 target calibrates in float16)
        cache = torch.zeros(1, model.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        with torch.no_grad():
            for g in groups:
                ids = torch.tensor([t for s in g for t in s], dtype=torch.int64)
                positions = torch.cat([torch.arange(len(s), dtype=torch.int64) for s in g])
                lens = torch.tensor([0] + [len(s) for s in g], dtype=torch.int32)
                cu = torch.cumsum(lens, 0, dtype=torch.int32)
                past = torch.zeros(len(g), dtype=torch.int32)
                table = torch.zeros(len(g), 1, dtype=torch.int32)
                # as LlamaForwardBatchModel.forward computes them
                cos, sin = model.rope_cos_sin(positions, dtype)
                local = model.rope_cos_sin(positions, dtype, local=True) if cfg.local_rope_theta is not None \
                    else (cos, sin)
                actx = AttentionContext(positions, cu, past, table, model.block_size, cfg.num_kv_heads)
                same = len({len(s) for s in g}) == 1
                self.batches.append(_Batch(cos, sin, actx, cache, cache, *local,
                                           len(g[0]) if self.dense and same else None))
                self.hidden.append(model.embed(ids))
        self.num_tokens = sum(len(s) for s in seqs)
        self._kept: _Kept | None = None

    def attention(self, layer: nn.Module, x: torch.Tensor, b: int) -> torch.Tensor:
        """layer.self_attn on the normalised input x of batch b (output only)."""
        bt = self.batches[b]
        cos, sin = (bt.cos_local, bt.sin_local) if layer.self_attn.local_rope else (bt.cos, bt.sin)
        if bt.seq_len is not None:
            return dense_attention(layer.self_attn, x, cos, sin, bt.seq_len)
        return layer.self_attn(x, cos, sin, bt.actx, bt.k_cache, bt.v_cache)[0]

    def attention_kv(self, layer: nn.Module, x: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (after q-k norm and RoPE) and values [T, kvh, d] layer.self_attn writes to its cache."""
        bt = self.batches[b]
        cos, sin = (bt.cos_local, bt.sin_local) if layer.self_attn.local_rope else (bt.cos, bt.sin)
        _q, k, v = layer.self_attn.project(x, cos, sin)
        return k, v

    def layer_forward(self, layer: nn.Module, x: torch.Tensor, b: int) -> torch.Tensor:
        kept = self._kept if self._kept is not None and self._kept.layer is layer else None
        if kept is None:
            return self.model.layer_forward(layer, x, lambda xn: self.attention(layer, xn, b))

        def attend(xn: torch.Tensor) -> torch.Tensor:
            if kept.attention[b] is None:
                kept.attention[b] = self.attention(layer, xn, b)
            return kept.attention[b]

        mlp = None
        handle = None
        if kept.mlp_input is not None:
            down = layer.mlp.down_proj
            if kept.mlp_input[b] is not None:
                mlp = lambda _xn: down(kept.mlp_input[b])  # noqa: E731  (the same input, the same output)
            else:  # before any other hook on it (LayerRunner.capture's may stop the forward there)
                def keep(_m: nn.Module, args: tuple[Any, ...]) -> None:
                    kept.mlp_input[b] = args[0].detach()
                handle = down.register_forward_pre_hook(keep, prepend=True)
        try:
            return self.model.layer_forward(layer, x, attend, mlp)
        finally:
            if handle is not None:
                handle.remove()

    def attention_final(self, index: int) -> None:
        """Layer `index`'s attention weights will not change before `advance(index)`: its next forward of each
        batch keeps the attention output and the later ones reuse it (tokens x hidden, the model's dtype)."""
        layer = self.model.layers[index]
        if self._kept is None or self._kept.layer is not layer:
            self._kept = _Kept(layer, [None] * len(self.hidden))

    def mlp_input_final(self, index: int) -> bool:
        """Layer `index`'s attention and the MLP's projections before its down projection will not change before
        `advance(index)` (only down_proj may): the next forward of each batch keeps down_proj's input (tokens x
        intermediate) and the later ones compute the MLP as down_proj of it. For the dense MLP (compiler.models.
        llama.MLP: down_proj(act(gate_proj(x)) * up_proj(x))) only; False where the layer's MLP is another."""
        from compiler.models.llama import MLP

        layer = self.model.layers[index]
        if type(layer.mlp) is not MLP:
            return False
        self.attention_final(index)
        if self._kept.mlp_input is None:
            self._kept.mlp_input = [None] * len(self.hidden)
        return True

    def outputs(self, index: int) -> list[torch.Tensor]:
        """Layer `index` applied to the current hidden states (nothing stored)."""
        layer = self.model.layers[index]
        with torch.no_grad():
            return [self.layer_forward(layer, x, b) for b, x in enumerate(self.hidden)]

    def advance(self, index: int) -> None:
        """Replace the hidden states by layer `index`'s outputs (with its current weights)."""
        self.hidden = self.outputs(index)
        self._kept = None

    def capture(self, index: int, modules: dict[str, nn.Module],
                sink: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, list[torch.Tensor]]:
        """Run layer `index`; the input of each named module, per batch (or streamed to `sink`). Modules fed the
        same tensor get the same float32 tensor object. A batch's forward stops once every named module has
        seen its input (what comes after them in the layer is not computed)."""
        layer = self.model.layers[index]
        seen: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        fired: set[str] = set()  # the named modules that saw their input in the current batch
        last: list[tuple[torch.Tensor, torch.Tensor]] = []  # the latest module input and its float32 copy
        handles = []
        for name, mod in modules.items():
            def hook(_m: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                raw = args[0]
                if last and last[0][0] is raw:
                    x = last[0][1]
                else:
                    x = raw.detach().reshape(-1, raw.shape[-1]).to(torch.float32)
                    last[:] = [(raw, x)]
                if sink is not None:
                    sink(name, x)
                else:
                    seen[name].append(x)
                fired.add(name)
                if len(fired) == len(modules):
                    raise _InputsSeen
            handles.append(mod.register_forward_pre_hook(hook))
        try:
            with torch.no_grad():
                for b, x in enumerate(self.hidden):
                    fired.clear()
                    try:
                        self.layer_forward(layer, x, b)
                    except _InputsSeen:
                        pass
                    last.clear()
        finally:
            for h in handles:
                h.remove()
        return seen
