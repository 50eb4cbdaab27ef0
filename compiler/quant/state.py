"""What the quantize_* passes hand to lower_quant (in ctx.artifacts["quant"]) and shared helpers.

The quantized tensors are data (STYLE 11): per weight name, the codes, scales and zero points the
artifact stores, plus how activations and the KV cache are quantized. The torch model holds the
dequantized weights, so our model definition computes what the artifact computes; the unquantized
model is kept as ctx.artifacts["reference_model"] for the quality gate (when the recipe has one).
A streamed build's calibrated passes read one decoder layer's weights at a time (`parameters_read`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from compiler.context import BuildContext, BuildError
from compiler.memory import trim_heap
from compiler.quant import int4
from compiler.quant.common import int4_bytes, matches, module_of  # noqa: F401 (re-exported)
from compiler.quant.fp8 import Fp8Weight
from compiler.quant.int4 import Int4Weight
from compiler.quant.int8 import Int8Weight
from compiler.streamed import as_torch

if TYPE_CHECKING:  # pragma: no cover
    from compiler.quant.calibration import LayerRunner


@dataclass
class QuantizedWeight:
    """One quantized weight: the parameter it replaces and its stored form."""

    name: str  # parameter name, e.g. "layers.0.mlp.down_proj.weight" (= the ONNX initializer name)
    method: str  # rtn | awq | gptq | fp8 | int8
    data: Int4Weight | Fp8Weight | Int8Weight
    kind: Literal["linear", "embedding"] = "linear"
    act_mode: Literal["none", "static", "dynamic"] = "none"  # FP8 activation quantization of the input
    act_scale: float | None = None  # static per-tensor scale of the input

    @property
    def scheme(self) -> str:
        if isinstance(self.data, Int8Weight):
            return "int8"
        return "int4" if isinstance(self.data, Int4Weight) else "fp8_e4m3"


@dataclass
class KvCacheQuant:
    """KV-cache quantization: dtype and per-(layer, KV head) scales for keys and values."""

    dtype: Literal["int8", "float8_e4m3fn"]
    k_scales: np.ndarray  # float32 [layers, kv_heads]
    v_scales: np.ndarray


@dataclass
class QuantState:
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    weight_method: str | None = None  # the pass that quantized the weights
    kv_cache: KvCacheQuant | None = None


def quant_state(ctx: BuildContext) -> QuantState:
    return ctx.artifacts.setdefault("quant", QuantState())


def begin(ctx: BuildContext, by: str, weights: bool = True) -> nn.Module:
    """Common start of a quantize pass: the model, a reference copy kept once, one weight method."""
    model = ctx.require("model", by)
    if "lower_onnx" in ctx.completed:
        raise BuildError(f"pass {by!r} must run before lower_onnx (it changes the weights that are lowered)")
    # the quality gate's reference (a second copy of the weights): kept only when the gate will evaluate
    if "reference_model" not in ctx.artifacts and ctx.recipe.quality.eval_data is not None:
        ctx.artifacts["reference_model"] = copy.deepcopy(model)
    st = quant_state(ctx)
    if weights and st.weight_method is not None:
        raise BuildError(f"pass {by!r}: the weights are already quantized by {st.weight_method!r}; "
                         "use one weight quantization pass per recipe")
    return model


def target_linears(model: nn.Module, ignore: tuple[str, ...] | list[str]) -> dict[str, nn.Linear]:
    """Linear modules by name, in model order, except those matching `ignore`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not matches(n, ignore)}


def write_weight(module: nn.Module, w: torch.Tensor) -> None:
    """Copy into the existing parameter (the exported program shares its storage)."""
    with torch.no_grad():
        module.weight.copy_(w.to(module.weight.dtype))


def layer_linears(layer: nn.Module, prefix: str, targets: dict[str, nn.Linear]) -> dict[str, nn.Linear]:
    """The target Linears inside one decoder layer, keyed by full module name."""
    return {f"{prefix}.{n}": m for n, m in layer.named_modules()
            if isinstance(m, nn.Linear) and f"{prefix}.{n}" in targets}


def progress_task(ctx: BuildContext, description: str, total: int) -> tuple[Any, Any]:
    """A sub-task on the build's progress display (None when progress is off)."""
    bar = ctx.artifacts.get("progress")
    if bar is None:
        return None, None
    return bar, bar.add_task(description, total=total)


def progress_done(bar: Any, task: Any) -> None:
    if bar is not None:
        bar.remove_task(task)


def stats_for(st: QuantState, model: nn.Module, skipped: dict[str, str]) -> dict[str, Any]:
    """Manifest stats common to the weight quantizers."""
    schemes: dict[str, int] = {}
    for q in st.weights.values():
        schemes[q.scheme] = schemes.get(q.scheme, 0) + 1
    return {
        "quantized": sorted(n.removesuffix(".weight") for n in st.weights),
        "quantized_count": len(st.weights),
        "schemes": schemes,
        "not_quantized": dict(sorted(skipped.items())),
    }


def skipped_modules(model: nn.Module, quantized: dict[str, Any], ignore: tuple[str, ...] | list[str],
                    embeddings_supported: bool = False) -> dict[str, str]:
    """Why each Linear/Embedding was left in float (for the manifest)."""
    out: dict[str, str] = {}
    for n, m in model.named_modules():
        if f"{n}.weight" in quantized:
            continue
        if isinstance(m, nn.Linear):
            out[n] = "ignore pattern" if matches(n, ignore) else "not quantized"
        elif isinstance(m, nn.Embedding):
            if not embeddings_supported:
                out[n] = "embedding: this method quantizes Linear weights only"
            else:
                out[n] = "ignore pattern" if matches(n, ignore) else "not quantized"
    return out


@contextmanager
def parameters_read(model: Any, deferred: dict[str, tuple[int, Any]], names: list[str]) -> Iterator[None]:
    """The streamed parameters `names` of `model` hold their checkpoint values for the duration (read one at
    a time from capture's `deferred_params`); then their unread storage again (the values are freed)."""
    kept: list[tuple[Any, Any]] = []
    try:
        for name in names:
            p = model.get_parameter(name)
            value = deferred[name][1].compute()
            if not value.flags.writeable:
                value = np.array(value)
            kept.append((p, p.data))
            p.data = as_torch(value).to(p.dtype)  # float32_search: upcast exactly
        yield
    finally:
        for p, unread in kept:
            p.data = unread
        kept.clear()
        trim_heap()


@dataclass
class QuantRun:
    """What every quantize pass opens with (`start_quantize`): the model, the quantization state, the target
    Linears (all but `ignore`), and a streamed build's unread parameters (capture's `deferred_params`:
    parameter -> its checkpoint reader); with the steps the passes share over them."""

    ctx: BuildContext
    by: str  # the pass
    model: nn.Module
    st: QuantState
    targets: dict[str, nn.Linear]
    deferred: dict[str, tuple[int, Any]]
    ignore: tuple[str, ...] | list[str]

    def streamed_under(self, prefix: str) -> list[str]:
        """The unread (streamed) parameters whose names start with `prefix`."""
        return [n for n in self.deferred if n.startswith(prefix)]

    def reading(self, prefix: str) -> Any:
        """A context in which the streamed parameters under `prefix` hold their checkpoint values."""
        return parameters_read(self.model, self.deferred, self.streamed_under(prefix))

    def layer_runner(self, samples: Any) -> LayerRunner:
        """The calibration windows' hidden states at the first decoder layer (a streamed embedding read for
        the while)."""
        from compiler.quant.calibration import LayerRunner

        with self.reading("embed_tokens."):
            return LayerRunner(self.model, samples)

    def layers(self, description: str, read: bool = True) -> Iterator[tuple[int, nn.Module, str]]:
        """Each decoder layer as (index, layer, "layers.<index>"), its streamed weights read for the while
        (`read`), as a task of the build's progress display."""
        bar, task = progress_task(self.ctx, description, len(self.model.layers))
        for i, layer in enumerate(self.model.layers):
            prefix = f"layers.{i}"
            if read:
                with self.reading(prefix + "."):
                    yield i, layer, prefix
            else:
                yield i, layer, prefix
            if bar is not None:
                bar.advance(task)
        progress_done(bar, task)

    def keep_int4(self, name: str, method: str, q: Int4Weight) -> None:
        """Record the INT4 weight `name`; a streamed layer's codes are spilled to disk (its weights are dropped
        with the layer)."""
        self.st.weights[name] = QuantizedWeight(name, method, int4.SpilledInt4(name, q) if name in self.deferred
                                                else q)

    def quantize_rest(self, method: str, streamed: Callable[[str, Any], Any], loaded: Callable[[torch.Tensor], Any]
                      ) -> int:
        """Each target Linear not quantized yet, by `method`: a streamed weight as `streamed(name, its checkpoint
        tensor)` (quantized when package writes it), a weight in memory as `loaded(weight)`, written back
        dequantized. Returns how many were streamed."""
        count = 0
        for name, lin in self.targets.items():
            key = f"{name}.weight"
            if key in self.st.weights:
                continue
            source = self.deferred.get(key)
            if source is not None:
                q = streamed(key, source[1])
                count += 1
            else:
                q = loaded(lin.weight)
                write_weight(lin, q.dequantize())
            self.st.weights[key] = QuantizedWeight(key, method, q)
        return count

    def round_rest(self, group_size: int, symmetric: bool = False) -> int:
        """quantize_rest to INT4 by round-to-nearest (the RTN pass; the Linears the calibrated methods leave)."""
        return self.quantize_rest(
            "rtn", lambda name, source: int4.StreamedInt4(name, source, group_size, symmetric),
            lambda w: int4.quantize_rtn(w, group_size, symmetric=symmetric))

    def finish(self, embeddings_supported: bool = False) -> dict[str, Any]:
        """The pass recorded as the weights' method; the manifest stats common to the weight quantizers."""
        self.st.weight_method = self.by
        return stats_for(self.st, self.model,
                         skipped_modules(self.model, self.st.weights, self.ignore, embeddings_supported))


def start_quantize(ctx: BuildContext, by: str, ignore: tuple[str, ...] | list[str] = (), weights: bool = True
                   ) -> QuantRun:
    """The opening of quantize pass `by` (`begin`'s checks and reference copy), on the Linears not in `ignore`."""
    model = begin(ctx, by, weights)
    return QuantRun(ctx, by, model, quant_state(ctx), target_linears(model, ignore),
                    ctx.artifacts.get("deferred_params", {}), ignore)
