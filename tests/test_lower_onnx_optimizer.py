"""lower_onnx's optimizer runs without onnxscript's SlicesSplit rule (compiler/export.py), and the
lowered graph is the one the exporter's full default rule set gives.

SlicesSplit is tried against every pair of Slice nodes (its cost grows with the square of the layer count);
taking it out must change nothing in the graphs capture produces. The check lowers the demo model's graph
both ways and compares the serialized models byte for byte, and checks that the installed onnxscript still
has the rule where lower_onnx looks for it (otherwise lower_onnx would silently run the slow rule set).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEMO_MODEL

from compiler.checkpoint import inspect_checkpoint
from compiler.export import export_forward_batch, graph_io_names, without_slice_split
from compiler.models.llama import LlamaForwardBatchModel


@pytest.mark.parametrize("attention", ["decomposed", "paged_cpu"])
def test_optimizer_without_slice_split_gives_the_same_graph(attention: str) -> None:
    import onnx_ir as ir
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.rules.common import slice_split_rule

    cfg = inspect_checkpoint(DEMO_MODEL, 1024).config
    model = LlamaForwardBatchModel.without_weights(cfg, 16, attention=attention)
    model.eval()
    exported, _ = export_forward_batch(model, cfg, 16, torch.float32)
    inputs, outputs = graph_io_names(cfg.num_layers)
    from compiler.attention.lowering import translation_table

    table = translation_table(attention)
    extra = {"custom_translation_table": table} if table else {}
    program = torch.onnx.export(exported, (), input_names=inputs, output_names=outputs, opset_version=21,
                                dynamo=True, optimize=False, verify=False, report=False, **extra)
    proto = ir.serde.serialize_model(program.model)
    assert sum(n.op_type == "Slice" for n in proto.graph.node) >= 2 * cfg.num_layers  # what the rule looks at

    every_rule = ir.serde.deserialize_model(proto)
    optimizer.optimize_ir(every_rule)
    fewer = ir.serde.deserialize_model(proto)
    before = rewriter._DEFAULT_REWRITE_RULES
    with without_slice_split() as taken_out:
        assert taken_out
        assert slice_split_rule in before and slice_split_rule not in rewriter._DEFAULT_REWRITE_RULES
        optimizer.optimize_ir(fewer)
    assert rewriter._DEFAULT_REWRITE_RULES is before  # restored
    a = ir.serde.serialize_model(every_rule).SerializeToString()
    b = ir.serde.serialize_model(fewer).SerializeToString()
    assert a == b
