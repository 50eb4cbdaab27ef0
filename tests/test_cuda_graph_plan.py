"""The CUDA-graph planning pass: decode buckets in the manifest, and its check that the decode graph
has static shapes per bucket and never needs the host to read tensor contents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import DEMO_MODEL, make_random_checkpoint, needs_ort, write_recipe
from onnx import TensorProto, helper
from onnx_model import make_model

from compiler.build import build, plan
from compiler.passes.plan_cuda_graphs import default_buckets, host_sync_findings
from compiler.recipe import RecipeError

PASSES = "  - name: capture\n  - name: lower_onnx\n  - name: plan_cuda_graphs\n{opts}  - name: package\n"


def _graph(nodes: list, inputs: list, outputs: list, inits: list | None = None) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    return make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _vi(name: str, elem: int = TensorProto.INT64, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape if shape is not None else ["n"])


def test_default_buckets_are_powers_of_two_up_to_max_num_seqs() -> None:
    assert default_buckets(16) == [1, 2, 4, 8, 16]
    assert default_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert default_buckets(1) == [1]


def test_a_shape_computed_from_input_contents_is_a_host_sync() -> None:
    # Reshape to a shape read from the *values* of `lens` (a host read), and to one from Shape(x) (fine)
    nodes = [
        helper.make_node("ReduceMax", ["lens"], ["m"], keepdims=1),
        helper.make_node("Concat", ["m", "minus1"], ["shape_v"], axis=0),
        helper.make_node("Reshape", ["x", "shape_v"], ["y"], name="by_value"),
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Reshape", ["x", "sx"], ["z"], name="by_shape"),
    ]
    m = _graph(nodes, [_vi("x", TensorProto.FLOAT), _vi("lens")], [_vi("y", TensorProto.FLOAT, None),
                                                                    _vi("z", TensorProto.FLOAT)],
               [onnx.numpy_helper.from_array(np.array([-1], np.int64), "minus1")])
    found = host_sync_findings(m)
    assert [f["node"] for f in found] == ["by_value"] and "derives from input contents" in found[0]["reason"]


@pytest.mark.parametrize("op,reason", [("NonZero", "output size depends"), ("Unique", "output size depends"),
                                       ("MyCustomOp", "not known")])
def test_data_dependent_and_unknown_ops_are_reported(op: str, reason: str) -> None:
    m = _graph([helper.make_node(op, ["x"], ["y"], name="n0")], [_vi("x")], [_vi("y")])
    found = host_sync_findings(m)
    assert len(found) == 1 and found[0]["op"] == op and reason in found[0]["reason"]


def test_control_flow_is_reported() -> None:
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "b", [], [_vi("o")])
    node = helper.make_node("If", ["c"], ["y"], name="if0", then_branch=branch, else_branch=branch)
    m = _graph([node], [_vi("c", TensorProto.BOOL, []), _vi("x")], [_vi("y")])
    assert [f["op"] for f in host_sync_findings(m)] == ["If"]


def test_slice_with_constant_bounds_of_a_value_tensor_is_fine() -> None:
    # slicing a value tensor is fine when the bounds are constants (the data flows, the shape does not)
    nodes = [helper.make_node("Slice", ["x", "zero", "one"], ["y"], name="s")]
    inits = [onnx.numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero", 0), ("one", 1))]
    m = _graph(nodes, [_vi("x")], [_vi("y")], inits)
    assert host_sync_findings(m) == []


def test_demo_build_records_the_plan_and_the_checks(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=3)
    recipe = write_recipe(tmp_path, ckpt, passes=PASSES.format(opts=""))
    artifact = build(recipe, progress=False)
    manifest = json.loads((artifact / "manifest.json").read_text())
    cg = manifest["cuda_graphs"]
    assert cg["applies"] is False and "device: cuda" in cg["reason"]  # a CPU target
    assert cg["capturable"] is True and cg["host_sync_findings"] == []
    assert cg["decode_buckets"] == [1, 2, 4, 8]  # max_num_seqs 8 in write_recipe
    assert cg["block_table_width"] == 512 // 16
    assert cg["bucket_inputs"]["4"] == {"input_ids": [4], "cu_seqlens": [5], "block_table": [4, 32]}
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "plan_cuda_graphs")
    assert stats["verified_buckets"] == [1, 2, 4, 8]  # ran on ONNX Runtime: fixed output shapes per bucket


def test_buckets_beyond_max_num_seqs_are_refused_at_plan_time(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL,
                          passes=PASSES.format(opts="    options:\n      decode_buckets: [1, 4, 64]\n"))
    with pytest.raises(RecipeError, match="exceeds runtime.max_num_seqs") as e:
        plan(recipe)
    assert e.value.field == "passes[2].options.decode_buckets" and e.value.line is not None


def test_buckets_must_increase(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL,
                          passes=PASSES.format(opts="    options:\n      decode_buckets: [4, 2]\n"))
    with pytest.raises(RecipeError, match="increasing"):
        plan(recipe)


@needs_ort("gqa")
def test_a_gqa_graph_is_reported_not_capturable(tmp_path: Path) -> None:
    """The gqa variant pads each step to its longest chunk, read from cu_seqlens: a shape from input
    contents, which a captured graph cannot have."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=3)
    passes = ("  - name: select_attention\n    options: {kernel: gqa}\n  - name: capture\n  - name: lower_onnx\n"
              "  - name: plan_cuda_graphs\n  - name: package\n")
    artifact = build(write_recipe(tmp_path, ckpt, passes=passes), progress=False)
    cg = json.loads((artifact / "manifest.json").read_text())["cuda_graphs"]
    assert cg["capturable"] is False and cg["applies"] is False
    assert cg["host_sync_findings"] and all(f["op"] == "Range" and "input contents" in f["reason"]
                                            for f in cg["host_sync_findings"])
