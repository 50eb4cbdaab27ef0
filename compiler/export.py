"""The model's exported forms, shared by the passes and the attention autotuner (which builds and times one-layer
models): the torch.export program with the ForwardBatch interface (its I/O names, example inputs and dynamic
shapes) and its lowering to ONNX.

Lowering uses the torch.onnx dynamo exporter (graph already captured), runs its optimizer (constant folding,
dead code), then strips the exporter's per-node metadata (stack traces with absolute paths, FX node text) so
that the same recipe and checkpoint give byte-identical model files. A fused attention variant
(select_attention) is translated to its contrib op (compiler/attention/lowering.py).

The optimizer runs without one of onnxscript's default rewrite rules, SlicesSplit (two Slices of one
value -> Split): it is a two-output pattern, tried against every pair of Slice nodes, so its cost grows
with the square of the layer count (most of the optimizer's time at 1B, more at 8B), and it cannot apply
to the graphs captured here (the rotary embedding's second half is sliced to the end of the axis, an
`end` the rule does not accept). tests/test_lower_onnx_optimizer.py checks the lowered graph is the same
with and without it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any

from compiler.context import BuildError
from compiler.streamed import STREAMED_LOCATION, register

log = logging.getLogger(__name__)


def graph_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "positions", "cu_seqlens", "past_lens", "block_table", "logits_index"]
    inputs += [f"{kind}_cache.{i}" for i in range(num_layers) for kind in ("key", "value")]
    outputs = ["logits"] + [f"new_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    return inputs, outputs


def example_inputs(cfg: Any, block_size: int, dtype: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Small example batch (distinct sizes so no dimension is specialised) and the dynamic shapes."""
    import torch

    t, b, max_blocks, num_blocks = 9, 3, 4, 11  # and 2 logits rows (logits_index below)
    args = (
        torch.zeros(t, dtype=torch.int64),
        torch.arange(t, dtype=torch.int64),
        torch.tensor([0, 3, 5, 9], dtype=torch.int32),
        torch.zeros(b, dtype=torch.int32),
        torch.zeros(b, max_blocks, dtype=torch.int32),
        torch.tensor([2, 8], dtype=torch.int64),
    )
    kv = tuple(
        torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        for _ in range(2 * cfg.num_layers)
    )
    dim = torch.export.Dim
    tokens = dim("num_tokens", min=1, max=1 << 16)
    seqs = dim("num_seqs", min=1, max=1 << 12)
    blocks = dim("max_blocks", min=1, max=1 << 16)
    pool = dim("num_blocks", min=1, max=1 << 24)
    logits = dim("num_logits", min=1, max=1 << 12)
    dynamic = {
        "input_ids": {0: tokens},
        "positions": {0: tokens},
        "cu_seqlens": {0: seqs + 1},
        "past_lens": {0: seqs},
        "block_table": {0: seqs, 1: blocks},
        "logits_index": {0: logits},
        "kv_cache": tuple({0: pool} for _ in kv),
    }
    return args + kv, dynamic


def export_forward_batch(model: Any, cfg: Any, block_size: int, dtype: Any, strict: bool = False) -> Any:
    """torch.export of a LlamaForwardBatchModel with the ForwardBatch's dynamic shapes (also used by the
    attention autotuner on a one-layer model)."""
    import torch

    args, dynamic = example_inputs(cfg, block_size, dtype)
    with torch.no_grad():
        return torch.export.export(model, args, dynamic_shapes=dynamic, strict=strict), args


def strip_metadata(model: Any) -> None:
    """Remove run-dependent text (stack traces, FX node dumps, doc strings) from an ONNX model."""

    def clear(graph: Any) -> None:
        del graph.metadata_props[:]
        graph.doc_string = ""
        for seq in (graph.input, graph.output, graph.value_info):
            for vi in seq:
                del vi.metadata_props[:]
                vi.doc_string = ""
        for init in graph.initializer:
            del init.metadata_props[:]
            init.doc_string = ""
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
            for attr in node.attribute:
                if attr.g is not None and attr.HasField("g"):
                    clear(attr.g)
                for g in attr.graphs:
                    clear(g)

    del model.metadata_props[:]
    model.doc_string = ""
    clear(model.graph)
    for fn in model.functions:
        del fn.metadata_props[:]
        fn.doc_string = ""
        for node in fn.node:
            del node.metadata_props[:]
            node.doc_string = ""


@contextlib.contextmanager
def without_slice_split() -> Iterator[bool]:
    """onnxscript's default rewrite rules without SlicesSplit while the exporter optimizes (module doc); yields
    whether the rule was taken out (False, with a warning, where this onnxscript lays its rules out otherwise)."""
    try:
        from onnxscript import rewriter
        from onnxscript.rewriter.rules.common import slice_split_rule

        rules = rewriter._DEFAULT_REWRITE_RULES
    except (ImportError, AttributeError):
        rules = None
    kept = None if rules is None else tuple(r for r in rules if r is not slice_split_rule)
    if kept is None or len(kept) == len(rules):
        log.warning("onnxscript's SlicesSplit rewrite rule was not found: the exporter's optimizer runs every "
                    "default rule (slower for models with many layers, the same graph)")
        yield False
        return
    rewriter._DEFAULT_REWRITE_RULES = kept
    try:
        yield True
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def defer_initializers(ir_model: Any, deferred: dict[str, tuple[int, Any]], max_loaded: int) -> int:
    """Replace each initializer that holds a deferred parameter's storage (capture left it unread) by a
    placeholder of the same name, shape and type (compiler/streamed.py); returns how many. An initializer
    over `max_loaded` elements that is not one of them was computed from weights by the exporter (e.g. a
    folded transpose) and cannot be streamed: BuildError."""
    import onnx_ir as ir
    import torch

    by_ptr = {ptr: (name, d) for name, (ptr, d) in deferred.items()}
    replaced = 0
    for value in ir_model.graph.initializers.values():
        tensor = value.const_value
        raw = getattr(tensor, "raw", None)
        found = by_ptr.get(raw.data_ptr()) if isinstance(raw, torch.Tensor) else None
        if found is None:
            if tensor is not None and tensor.size > max_loaded:
                raise BuildError(f"ONNX lowering: initializer {value.name!r} ({tensor.size} elements) is not a "
                                 "checkpoint tensor (the exporter computed it from weights): it cannot be streamed; "
                                 "set capture's weights: load")
            continue
        name, d = found
        if not raw.is_contiguous() or tuple(raw.shape) != d.shape or raw.storage_offset() != 0:
            raise BuildError(f"ONNX lowering: initializer {value.name!r} is a view of parameter {name}, not the "
                             "parameter: it cannot be streamed; set capture's weights: load")
        value.const_value = ir.ExternalTensor(STREAMED_LOCATION, register(d), d.size * d.dtype.itemsize,
                                              tensor.dtype, shape=tensor.shape, name=value.name)
        replaced += 1
    return replaced


def lower_exported(exported: Any, num_layers: int, opset: int = 21, optimize: bool = True,
                   attention: str = "decomposed", deferred: dict[str, tuple[int, Any]] | None = None,
                   max_loaded: int = 0) -> Any:
    """torch.onnx export of a captured ForwardBatch graph -> ModelProto with metadata stripped (also used
    by the attention autotuner). `deferred` (capture's deferred parameters): their initializers become
    streamed placeholders (defer_initializers). Raises BuildError."""
    import torch

    from compiler.attention.lowering import drop_unused_outputs, translation_table

    inputs, outputs = graph_io_names(num_layers)
    table = translation_table(attention)
    extra = {"custom_translation_table": table} if table else {}
    chatter = io.StringIO()  # the exporter prints its progress; keep it for the debug log
    try:
        with contextlib.redirect_stdout(chatter), warnings.catch_warnings(), without_slice_split():
            warnings.simplefilter("ignore", FutureWarning)
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(
                exported,
                (),
                input_names=inputs,
                output_names=outputs,
                opset_version=opset,
                dynamo=True,
                optimize=optimize,
                verify=False,
                report=False,
                **extra,
            )
    except Exception as e:
        raise BuildError(f"ONNX lowering failed: {str(e).splitlines()[0]}") from e
    finally:
        log.debug("torch.onnx.export output:\n%s", chatter.getvalue())
    if deferred:
        defer_initializers(program.model, deferred, max_loaded)
    model = program.model_proto
    del program
    if table:
        drop_unused_outputs(model)
    strip_metadata(model)
    model.producer_name = "optimize"
    model.producer_version = ""
    got_in = [i.name for i in model.graph.input]
    got_out = [o.name for o in model.graph.output]
    if got_in != inputs or got_out != outputs:
        raise BuildError(f"lowered graph has inputs {got_in} / outputs {got_out}, expected {inputs} / {outputs}")
    return model
