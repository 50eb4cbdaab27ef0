"""INT4 AWQ: activation-aware per-channel scaling plus weight clipping, searched on calibration data.

Layer by layer over the recipe's calibration windows (compiler/quant/calibration.py): capture each
Linear's input, search and fold the scales of each input-sharing group, search the clipping range
of each Linear but q/k, then round to nearest with those ranges (compiler/quant/awq.py). The next
layer's input is the unquantized layer's output, as in AutoAWQ. `rounding: gptq` replaces the
round-to-nearest (and the clip search) by GPTQ on each scaled Linear: AWQ's scales with GPTQ's
rounding, a hybrid, not plain AWQ. `search: fit` replaces both searches: the same scales and
(asymmetric) clipping ranges, fitted end to end against the float model's next-token distribution
(compiler/quant/awq_fit.py); the stored form is still AWQ's (Q(W * s) rounded to nearest).

With streamed weights (compiler/streamed.py) the grid searches hold one decoder layer at a time, as
quantize_gptq does: the embedding read for the calibration hidden states, then each layer's weights read
from the checkpoint, searched, folded (the norms, which capture read, take 1/s in memory), rounded, their
INT4 codes spilled to disk and the weights dropped. `search: fit` and an `ignore` matching a decoder
layer's Linear hold the whole model (`streaming_problem`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from compiler.passes.base import BuildContext, BuildError, QuantizePass
from compiler.quant.common import Int4WeightSizes, check_group_size, matches

if TYPE_CHECKING:  # pragma: no cover
    from compiler.quant.calibration import LayerRunner
    from compiler.quant.state import QuantRun

log = logging.getLogger(__name__)

# Input-sharing groups of a Llama-family decoder layer: (name, op before, consumers, measured block).
# The block is "attention", "mlp" or a Linear measured on its own.
LLAMA_SCALE_GROUPS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attention"),
    ("o", "self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ("gate_up", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ("down", "mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)


@dataclass(frozen=True)
class ScaleGroupSpec:
    """One input-sharing group of a layer: its Linears, the op before them, where its input is read."""

    name: str
    prev: str  # the op whose output channels absorb 1/s
    consumers: tuple[str, ...]  # the Linears scaled by s (quantized unless ignored)
    block: str  # measured block: "attention", "mlp" or a Linear on its own
    source: str  # the module whose input is the group's input
    scaled: tuple[str, ...] = ()  # float readers of the same input (a mixture's routers): scaled only


def scale_groups(layer: Any) -> list[ScaleGroupSpec]:
    """The layer's groups: LLAMA_SCALE_GROUPS; in a mixture-of-experts layer, one gate/up group of every
    expert (and the shared expert) after post_attention_layernorm, measured on the whole MoE block with
    the routers scaled alongside, then each expert's down after its own up."""
    from compiler.models.moe import SparseMoeBlock

    groups = [ScaleGroupSpec(n, p, c, b, c[0]) for n, p, c, b in LLAMA_SCALE_GROUPS]
    moe = layer.mlp
    if not isinstance(moe, SparseMoeBlock):
        return groups
    experts = [f"mlp.experts.{e}" for e in range(len(moe.experts))] + (["mlp.shared_expert"] if moe.shared else [])
    routers = ("mlp.gate",) + (("mlp.shared_expert_gate",) if moe.shared else ())
    return groups[:2] + [ScaleGroupSpec("gate_up", "post_attention_layernorm",
                                        tuple(f"{e}.{r}" for e in experts for r in ("gate_proj", "up_proj")),
                                        "mlp", "mlp", routers)] + [
        ScaleGroupSpec(f"down.{e.removeprefix('mlp.')}", f"{e}.up_proj", (f"{e}.down_proj",), f"{e}.down_proj",
                       f"{e}.down_proj") for e in experts]


def clip_source(g: ScaleGroupSpec, consumer: str) -> str:
    """The module whose input `consumer` reads: the group's (also for the shared expert, which reads every
    token), except a routed expert's gate/up, which read the rows routed to it (its gate_proj's input)."""
    if g.source != "mlp" or consumer.startswith("mlp.shared_expert."):
        return g.source
    return consumer.rsplit(".", 1)[0] + ".gate_proj"


@dataclass
class _GridReport:
    """What the grid searches report in the manifest, gathered over the layers."""

    ratios: dict[str, float] = field(default_factory=dict)
    skipped_groups: dict[str, str] = field(default_factory=dict)
    unseen: list[str] = field(default_factory=list)  # Linears no calibration token reached (experts): to nearest
    clipped: int = 0


@dataclass(frozen=True)
class AwqOptions:
    group_size: int = 128
    n_grid: int = 20  # scale ratios tried: i / n_grid for i < n_grid
    duo_scaling: bool | str = True  # s = x_mean^a / w_mean^(1-a) (False: x_mean^a; "both": either, least loss)
    # each group's input measured with the layer's earlier groups quantized, and the next layer fed the
    # quantized layer's output (as GPTQ); False: every input from the float model (AutoAWQ)
    sequential: bool = False
    clip: bool = True  # the weight-clipping search
    max_shrink: float = 0.5  # clipping tries max|w| * (1 - i/n_grid) for i < max_shrink * n_grid
    clip_tokens: int = 512  # calibration tokens of the clipping search (evenly spaced)
    # Linears left unclipped (name patterns); q/k by default: the attention softmax amplifies their errors
    clip_skip: list[str] = field(default_factory=lambda: ["q_proj", "k_proj"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    # how the scaled weights are rounded: "nearest" (AWQ) or "gptq" (GPTQ's error feedback through the
    # Hessian of each Linear's scaled input, act_order and range_search as recipes/demo-int4-gptq.yaml;
    # no clip search: GPTQ's range search takes its place). "gptq" is AWQ scaling + GPTQ, not plain AWQ.
    rounding: str = "nearest"
    gptq_damp: float = 0.01  # rounding "gptq": dampening, as quantize_gptq's damp
    # "grid": AutoAWQ's searches (scale ratio grid per group, then the clip search per Linear); "fit": the
    # scales and per-(row, group) clipping of min and max fitted by gradient descent on the KL divergence of
    # the quantized model's next-token distribution from the float model's (compiler/quant/awq_fit.py)
    search: str = "grid"
    fit_epochs: int = 10  # search "fit": passes over the calibration batches
    fit_lr_scale: float = 0.05  # search "fit": Adam's learning rate of log s (cosine schedule)
    fit_lr_clip: float = 0.2  # search "fit": Adam's learning rate of the clipping logits
    fit_batch_tokens: int = 4096  # search "fit": calibration tokens per step (whole windows)

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        if self.search not in ("grid", "fit"):
            raise ValueError(f"search must be 'grid' or 'fit', got {self.search!r}")
        if self.search == "fit" and (self.rounding != "nearest" or self.sequential):
            raise ValueError("search 'fit' fits the whole model at once for round-to-nearest: rounding 'gptq' and "
                             "sequential apply to search 'grid'")
        if self.fit_epochs < 1 or self.fit_lr_scale <= 0 or self.fit_lr_clip <= 0 or self.fit_batch_tokens < 1:
            raise ValueError("fit_epochs and fit_batch_tokens must be >= 1 and fit_lr_scale, fit_lr_clip > 0")
        if self.rounding not in ("nearest", "gptq"):
            raise ValueError(f"rounding must be 'nearest' or 'gptq', got {self.rounding!r}")
        if not 0 < self.gptq_damp < 1:
            raise ValueError(f"gptq_damp must be in (0, 1), got {self.gptq_damp}")
        if self.duo_scaling not in (True, False, "both"):
            raise ValueError(f"duo_scaling must be true, false or 'both', got {self.duo_scaling!r}")
        if self.n_grid < 1 or not 0 <= self.max_shrink < 1 or self.clip_tokens < 1:
            raise ValueError("n_grid and clip_tokens must be >= 1 and max_shrink in [0, 1)")


class QuantizeAwqPass(Int4WeightSizes, QuantizePass):
    """INT4 weight-only AWQ: activation-aware scale search and clipping search, then round to nearest."""

    name: ClassVar[str] = "quantize_awq"
    Config = AwqOptions
    summary = "INT4 weight-only AWQ (scale + clip search on calibration data), asymmetric, per group"

    def needs_calibration(self) -> bool:
        return True

    def streaming_problem(self, info: Any) -> str | None:
        """Why this pass cannot run on streamed weights (compiler/memory.py streaming_reason), or None."""
        c = self.config
        if c.search == "fit":
            return ("quantize_awq search 'fit' fits every layer's scales and clipping at once, end to end against "
                    "the float model's next-token distribution, so it holds the whole model: about 3 W (W the "
                    "float32 weights: the model, the originals and each Linear's fake-quantized copy kept for the "
                    "backward pass) plus every layer's activations over fit_batch_tokens tokens; search 'grid' "
                    "streams one layer at a time")
        layer = [n.removeprefix("model.").removesuffix(".weight") for n, (_dtype, shape) in info.tensors.items()
                 if n.startswith("model.layers.0.") and n.endswith(".weight") and len(shape) == 2]
        ignored = [n for n in layer if matches(n, c.ignore)]
        if ignored:
            return (f"quantize_awq ignores {ignored[0]}: a decoder layer's Linear left in float still takes its "
                    "group's AWQ scales, a changed float weight that streaming cannot write")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from compiler.quant.calibration import float32_search, load_calibration
        from compiler.quant.state import start_quantize

        c = self.config
        if ctx.checkpoint.config.post_norm:  # the scale groups fold scales into the norm before each group
            raise BuildError(f"{self.name}: {ctx.checkpoint.config.architecture} normalises the attention's and "
                             "the MLP's outputs (post-norm), so no norm precedes q/k/v or gate/up to fold AWQ's "
                             "scales into; use quantize_gptq or quantize_rtn")
        q = start_quantize(ctx, self.name, c.ignore)
        with float32_search(q.model, q.deferred):  # searches in float32 on the target's weights
            cal = load_calibration(ctx, self.name)
            if c.search == "fit":
                if q.deferred:  # compiler/memory.py streaming_reason refuses this recipe before the build
                    raise BuildError(f"{self.name}: search 'fit' fits every layer at once and needs the whole model")
                return self._run_fit(ctx, q, cal)
            runner = q.layer_runner(cal.samples)
            report = _GridReport()
            for i, layer, prefix in q.layers("awq"):
                stored = self._quantize_layer(i, layer, runner, q.targets, report)
                for n, w in stored.items():
                    method = "rtn" if f"{prefix}.{n}" in report.unseen else "awq"
                    q.keep_int4(f"{prefix}.{n}.weight", method, w)
            q.round_rest(c.group_size)  # Linears outside the decoder layers' groups (an un-ignored lm_head)
            extra = {"streamed_layers": len(q.model.layers)} if q.deferred else {}
            return {"method": "awq", "bits": 4, "group_size": c.group_size, "symmetric": False,
                    "rounding": c.rounding, "search": "grid", "calibration": cal.record,
                    "scale_ratios": dict(sorted(report.ratios.items())),
                    "scale_groups_skipped": dict(sorted(report.skipped_groups.items())),
                    "clipped_linears": report.clipped, "unseen_rtn": report.unseen,
                    **q.finish(), **extra}

    def _quantize_layer(self, i: int, layer: Any, runner: LayerRunner, targets: dict[str, Any],
                        report: _GridReport) -> dict[str, Any]:
        """Decoder layer i by the grid searches: each group's scales searched and folded, then its Linears
        clipped and rounded; the runner then holds the next layer's input. Returns the layer's INT4 weights
        by name within the layer."""
        from compiler.quant import awq
        from compiler.quant.state import write_weight

        c = self.config
        prefix = f"layers.{i}"
        groups = scale_groups(layer)
        names = {n for g in groups for n in (*g.consumers, *g.scaled, g.source)}
        mods = {n: m for n, m in layer.named_modules() if n in names}
        sources = {n for g in groups for n in (g.source, *(clip_source(g, c) for c in g.consumers))}
        if not c.sequential:
            inputs = runner.capture(i, {n: mods[n] for n in sources})
            next_hidden = runner.outputs(i)  # the unquantized layer's output feeds the next layer
        stored: dict[str, Any] = {}  # this layer's quantized Linears: name -> Int4Weight
        for g in groups:
            # sequential: the group's input with the layer's earlier groups already quantized
            if c.sequential:
                mine = {g.source, *(clip_source(g, n) for n in g.consumers)}
                inputs = runner.capture(i, {n: mods[n] for n in mine})
            x = inputs[g.source]
            linears = [mods[n] for n in g.consumers]
            prev = layer.get_submodule(g.prev)
            tie = None
            scale = True
            if not any(t.shape[0] for t in x):  # an expert no calibration token was routed to
                report.skipped_groups[f"{prefix}.{g.name}"] = "no scaling: no calibration token reached it"
                scale = False
            else:
                scale, tie = self._fold(layer, prefix, g, linears[0].in_features, report.skipped_groups)
            quantize_mask = [f"{prefix}.{n}" in targets for n in g.consumers]
            if scale and any(quantize_mask):
                # the routers read the same input: scaled with the experts, never quantized
                group = awq.ScaleGroup(f"{prefix}.{g.name}", prev, linears + [mods[n] for n in g.scaled],
                                       quantize_mask + [False] * len(g.scaled), x,
                                       self._block(runner, layer, g.block), tie)
                sc, ratio, _ = awq.search_scale(group, c.group_size, c.n_grid, c.duo_scaling)
                awq.apply_scale(group, sc)
                for n in {clip_source(g, m) for m in g.consumers} - {g.source}:
                    for t in inputs[n]:  # the routed experts' own rows, which apply_scale did not see
                        t.div_(sc)
                report.ratios[group.name] = ratio
                if g.prev in stored:  # rows of an already quantized Linear / s: its scales / s
                    stored[g.prev] = awq.rescale_rows(stored[g.prev], group.tied(sc)[1])
                    write_weight(prev, stored[g.prev].dequantize())
            if c.sequential:
                report.clipped += self._quantize(prefix, g, mods, targets, inputs, stored, report.unseen)
        if not c.sequential:
            for g in groups:
                report.clipped += self._quantize(prefix, g, mods, targets, inputs, stored, report.unseen)
        if c.sequential:
            runner.advance(i)  # the quantized layer's output feeds the next layer
        else:
            runner.hidden = next_hidden
        return stored

    def _run_fit(self, ctx: BuildContext, q: QuantRun, cal: Any) -> dict[str, Any]:
        """search "fit": every layer's scale groups fitted at once (awq_fit.fit), then folded and rounded
        group by group in layer order; a later group's scale divides the rows of an already stored
        Linear (v before o, up before down) exactly, as awq.rescale_rows."""
        import torch

        from compiler.models.moe import SparseMoeBlock
        from compiler.quant import awq_fit
        from compiler.quant.calibration import LayerRunner
        from compiler.quant.state import progress_done, progress_task

        c = self.config
        model = q.model
        if any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers):
            raise BuildError(f"{self.name}: search 'fit' does not cover mixture-of-experts layers; use search 'grid'")
        runner = LayerRunner(model, cal.samples, c.fit_batch_tokens)
        if not runner.dense:
            raise BuildError(f"{self.name}: search 'fit' needs every layer to attend to its whole causal past with "
                             f"plain softmax scores ({ctx.checkpoint.config.architecture} has sliding windows or "
                             "soft-capping); use search 'grid'")
        skipped_groups: dict[str, str] = {}
        plan = self._fit_plan(model, q.targets, skipped_groups)

        def forward(b: int) -> torch.Tensor:
            x = runner.hidden[b]  # the embeddings of batch b
            for layer in model.layers:
                x = runner.layer_forward(layer, x, b)
            return model.head(x)

        bar, task = progress_task(ctx, "awq fit", c.fit_epochs)
        result = awq_fit.fit([fg for *_, fg in plan], len(runner.hidden), forward, c.group_size, c.fit_epochs,
                             c.fit_lr_scale, c.fit_lr_clip, seed=int(cal.record["seed"]),
                             on_epoch=lambda _e, _kl: bar.advance(task) if bar is not None else None)
        progress_done(bar, task)
        stored, spread = self._apply_fit(plan, result)
        for name, w in stored.items():
            q.keep_int4(f"{name}.weight", "awq", w)
        q.round_rest(c.group_size)  # outside the scale groups (an un-ignored lm_head): to nearest
        factors = torch.cat([torch.cat([a.flatten(), b.flatten()]) for a, b in result.clips.values()])
        return {"method": "awq", "bits": 4, "group_size": c.group_size, "symmetric": False, "rounding": "nearest",
                "search": "fit", "calibration": cal.record,
                "fit": {"epochs": c.fit_epochs, "batches": len(runner.hidden), "batch_tokens": c.fit_batch_tokens, "lr_scale": c.fit_lr_scale,
                        "lr_clip": c.fit_lr_clip, "kl_per_epoch": [round(k, 6) for k in result.kl],
                        "clip_factor_mean": round(float(factors.mean()), 4),
                        "clip_factor_min": round(float(factors.min()), 4)},
                "scale_spread": dict(sorted(spread.items())),  # max(s) / min(s) of each group
                "scale_groups_skipped": dict(sorted(skipped_groups.items())),
                **q.finish()}

    def _fit_plan(self, model: Any, targets: dict[str, Any], skipped_groups: dict[str, str]
                  ) -> list[tuple[str, Any, ScaleGroupSpec, Any]]:
        """search "fit": every layer's scale groups in layer order, as (layer prefix, layer, group, FitGroup);
        a group whose scale cannot fold into the op before it is fitted unscaled and named in `skipped_groups`."""
        from compiler.quant import awq_fit

        plan: list[tuple[str, Any, ScaleGroupSpec, awq_fit.FitGroup]] = []
        for i, layer in enumerate(model.layers):
            prefix = f"layers.{i}"
            for g in scale_groups(layer):
                lins = [(f"{prefix}.{n}", layer.get_submodule(n), f"{prefix}.{n}" in targets) for n in g.consumers]
                tie, scaled = None, any(t for _, _, t in lins)
                if scaled:
                    scaled, tie = self._fold(layer, prefix, g, lins[0][1].in_features, skipped_groups)
                plan.append((prefix, layer, g, awq_fit.FitGroup(f"{prefix}.{g.name}", lins, tie, scaled)))
        return plan

    def _apply_fit(self, plan: list[tuple[str, Any, ScaleGroupSpec, Any]], result: Any
                   ) -> tuple[dict[str, Any], dict[str, float]]:
        """The fitted scales folded and the target Linears rounded with their fitted clipping, group by group
        in `plan`'s order, their weights replaced by the dequantized values. (full Linear name -> its INT4
        weight, group -> max(s) / min(s))"""
        from compiler.quant import awq, awq_fit, int4
        from compiler.quant.state import write_weight

        c = self.config
        stored: dict[str, int4.Int4Weight] = {}  # full Linear name -> its INT4 weight
        spread: dict[str, float] = {}
        for prefix, layer, g, fg in plan:
            s = result.scales.get(fg.name)
            if s is not None:
                group = awq.ScaleGroup(fg.name, layer.get_submodule(g.prev), [lin for _, lin, _ in fg.linears],
                                       [t for *_, t in fg.linears], [], None, fg.tie)  # type: ignore[arg-type]
                awq.apply_scale(group, s)
                spread[fg.name] = round(float(s.max() / s.min()), 3)
                prev_full = f"{prefix}.{g.prev}"
                if prev_full in stored:  # rows of an already stored Linear / s: its scales / s
                    stored[prev_full] = awq.rescale_rows(stored[prev_full], group.tied(s)[1])
                    write_weight(layer.get_submodule(g.prev), stored[prev_full].dequantize())
            for name, lin, target in fg.linears:
                if target:
                    f_max, f_min = result.clips[name]
                    stored[name] = awq_fit.quantize(lin.weight, c.group_size, f_max, f_min)
                    write_weight(lin, stored[name].dequantize())
        return stored, spread

    def _quantize(self, prefix: str, g: ScaleGroupSpec, mods: dict[str, Any], targets: dict[str, Any],
                  inputs: dict[str, list[Any]], stored: dict[str, Any], unseen: list[str]) -> int:
        """Round the group's target Linears to INT4 (after the clip search on each one's own input, unless
        off) into `stored`, their weights replaced by the dequantized values; returns how many were clipped.
        A Linear no calibration token reached (an expert) is rounded to nearest and listed in `unseen`."""
        from compiler.quant import awq, int4
        from compiler.quant.state import write_weight

        c = self.config
        clipped = 0
        hessians: dict[str, Any] = {}  # rounding "gptq": per input (a group's Linears share one)
        for n in g.consumers:
            full = f"{prefix}.{n}"
            if full not in targets:
                continue
            lin = mods[n]
            x = inputs[clip_source(g, n)]
            if c.rounding == "gptq" and any(t.shape[0] for t in x):
                from compiler.quant import gptq

                src = clip_source(g, n)
                if src not in hessians:
                    hessians[src] = gptq.Hessian(lin.in_features)
                    for xb in x:
                        hessians[src].add(xb)
                try:
                    q, _loss = gptq.gptq_quantize(lin.weight, hessians[src].value(), c.group_size, c.gptq_damp,
                                                  act_order=True, range_search=True)
                except ValueError as e:
                    raise BuildError(f"{self.name}: {full}: {e}") from e
                write_weight(lin, q.dequantize())
                stored[n] = q
                continue
            max_val = None
            if not any(t.shape[0] for t in x):
                unseen.append(full)
            elif c.clip and not matches(full, c.clip_skip):
                max_val = awq.search_clip(lin.weight, x, c.group_size, c.n_grid, c.max_shrink, c.clip_tokens)
                clipped += 1
            q = int4.quantize_rtn(lin.weight, c.group_size, max_val)
            write_weight(lin, q.dequantize())
            stored[n] = q
        return clipped

    def _fold(self, layer: Any, prefix: str, g: ScaleGroupSpec, in_features: int, skipped: dict[str, str]
              ) -> tuple[bool, Any]:
        """(whether g's scale folds into g.prev, the GQA tie of v -> o or None); a group whose previous
        Linear has other outputs than its Linears' inputs, not as v -> o under GQA, is named in `skipped`."""
        from torch import nn

        prev = layer.get_submodule(g.prev)
        if not isinstance(prev, nn.Linear) or prev.out_features == in_features:
            return True, None
        tie = self._gqa_tie(layer, g.prev, g.consumers[0])
        if tie is None:
            skipped[f"{prefix}.{g.name}"] = (f"no scaling: {g.prev} has {prev.out_features} outputs, "
                                             f"{g.consumers[0]} {in_features} inputs")
            return False, None
        return True, tie

    @staticmethod
    def _gqa_tie(layer: Any, prev_name: str, consumer: str) -> Any:
        """v_proj -> o_proj under grouped-query attention: o's input channel (head h, dim j) comes from
        v's output channel (h // group, j); None when the pair is not that."""
        import torch

        attn = layer.self_attn
        if (prev_name, consumer) != ("self_attn.v_proj", "self_attn.o_proj") or attn.h % attn.kvh:
            return None
        h = torch.arange(attn.h * attn.d) // attn.d
        j = torch.arange(attn.h * attn.d) % attn.d
        return (h // (attn.h // attn.kvh)) * attn.d + j

    @staticmethod
    def _block(runner: LayerRunner, layer: Any, block: str) -> Any:
        if block == "attention":
            return lambda b, x: runner.attention(layer, x, b)
        if block == "mlp":
            return lambda b, x: layer.mlp(x)
        lin = layer.get_submodule(block)
        return lambda b, x: lin(x)
