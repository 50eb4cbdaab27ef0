"""Graph capture: build our model definition from the checkpoint and trace it with torch.export.

The traced graph has the ForwardBatch interface (dynamic token, sequence, block and pool
dimensions) plus the per-layer KV pools as inputs, and logits plus each layer's new K/V as outputs.
The attention variant is the select_attention pass's choice (ctx.artifacts["attention"]), else the
decomposed paged attention in standard ops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from compiler.checkpoint import lazy_weights
from compiler.export import export_forward_batch
from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.streamed import Deferred
from compiler.targets import supported, target_for

log = logging.getLogger(__name__)

# a streamed build loads the parameters up to this many elements (norms, biases: what the exporter's
# constant folding may read: onnxscript folds inputs of at most 8192 elements) and defers the others
STREAM_MAX_LOADED = 1 << 14


@dataclass(frozen=True)
class CaptureOptions:
    strict: bool = False  # torch.export strict mode (TorchDynamo); non-strict traces in Python
    # stream: large weights are not loaded; the artifact writer reads them one at a time (compiler/streamed.py);
    # load: the whole model in memory; auto: stream where the recipe allows (compiler/memory.py streaming_reason)
    weights: Literal["auto", "stream", "load"] = "auto"

    def __post_init__(self) -> None:
        if self.weights not in ("auto", "stream", "load"):
            raise ValueError(f"weights must be auto, stream or load, got {self.weights!r}")


def attention_variant(ctx: BuildContext) -> str:
    """The attention variant chosen by select_attention (default: decomposed)."""
    choice = ctx.artifacts.get("attention")
    return choice["variant"] if choice else "decomposed"


def deferred_params(model: Any, weights: Any, dtype: Any) -> dict[str, tuple[int, Any]]:
    """Parameter name -> (its storage address, a Deferred reading its value from the checkpoint) for the
    parameters load_hf_state_dict deferred."""
    import torch

    from compiler.models.llama import hf_value
    from compiler.quant.onnx_rules import torch_to_numpy
    cfg = model.cfg
    np_dtype = torch_to_numpy(torch.zeros(0, dtype=dtype), dtype).dtype
    out: dict[str, tuple[int, Any]] = {}
    for name, p in model.named_parameters():
        src = model.deferred_sources.get(name)
        if src is None:
            continue

        def read(name: str = name, src: str = src) -> Any:
            return torch_to_numpy(hf_value(cfg, name, weights[src], dtype), dtype)

        def rows(a: int, b: int, name: str = name, src: str = src) -> Any:  # the same conversion, row by row
            return torch_to_numpy(hf_value(cfg, name, weights.rows(src, a, b), dtype), dtype)

        by_rows = hasattr(weights, "rows") and p.ndim >= 2 and tuple(weights.shape(src)) == tuple(p.shape)
        out[name] = (p.data_ptr(), Deferred(tuple(p.shape), np_dtype, read, rows=rows if by_rows else None))
    return out


class CapturePass(Pass):
    """Trace our model definition into a torch.export graph with the ForwardBatch interface."""

    name: ClassVar[str] = "capture"
    Config = CaptureOptions
    summary = "load weights into the model definition (one tensor at a time); torch.export with dynamic ForwardBatch shapes"

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import torch

        from compiler.models.llama import LlamaForwardBatchModel

        target = ctx.recipe.target
        spec = target_for(target.backend, target.device)
        if spec is None or target.dtype not in spec.dtypes:
            raise BuildError(f"target {target.backend}/{target.device}/{target.dtype} is not supported by this "
                             f"build; supported: {supported()}")
        cfg = ctx.checkpoint.config
        block_size = ctx.recipe.runtime.kv_block_size
        dtype = getattr(torch, target.dtype)
        torch.manual_seed(0)
        variant = attention_variant(ctx)
        # parameters allocated once, each filled from its checkpoint tensor as it is read (one at a time);
        # a streamed build leaves the large ones unread (their storage is never touched, so never resident)
        model = LlamaForwardBatchModel.without_weights(cfg, block_size, attention=variant)
        weights = lazy_weights(ctx.checkpoint)
        streamed = bool(ctx.artifacts.get("streamed"))
        defer = (lambda _name, p: p.numel() > STREAM_MAX_LOADED) if streamed else None
        unused = model.load_hf_state_dict(weights, dtype, defer)
        if streamed:
            ctx.artifacts["deferred_params"] = deferred_params(model, weights, dtype)
        if unused:
            log.info("checkpoint tensors not used by the model definition: %s", ", ".join(unused[:8]))
        model.eval()
        try:
            exported, args = export_forward_batch(model, cfg, block_size, dtype, self.config.strict)
        except Exception as e:  # torch.export's errors are long; keep the first line in ours
            raise BuildError(f"torch.export failed: {str(e).splitlines()[0]}") from e
        ctx.artifacts["model"] = model
        ctx.artifacts["exported"] = exported
        ctx.artifacts["example_inputs"] = args
        n_params = sum(p.numel() for p in model.parameters())
        extra = {"attention": variant} if "attention" in ctx.artifacts else {}
        if streamed:
            extra["streamed_parameters"] = len(ctx.artifacts["deferred_params"])
        return {
            **extra,
            "architecture": cfg.architecture,
            "parameters": n_params,
            "graph_nodes": len(exported.graph.nodes),
            "dynamic_dims": ["num_tokens", "num_seqs", "max_blocks", "num_blocks", "num_logits"],
            "kv_block_size": block_size,
            "unused_checkpoint_tensors": unused,
        }
