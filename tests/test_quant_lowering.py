"""ONNX rewrites of compiler/quant/onnx_rules.py on tiny graphs: ONNX Runtime before and after, the
op present after, outputs within tolerance; graphs that must not fuse say why (STYLE 9)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import needs_ort
from onnx import TensorProto, helper, numpy_helper
from onnx_model import make_model

from compiler.quant import int4
from compiler.quant import onnx_rules as R
from compiler.quant.state import KvCacheQuant, QuantizedWeight

N, K = 24, 200  # K is not a multiple of the group size: the last group is short


def _gemm_model(w: np.ndarray, trans_b: int = 1, bias: bool = False, extra_use: bool = False) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(w, "w")]
    gemm_in = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(np.ones(w.shape[0], np.float32), "b"))
        gemm_in.append("b")
    nodes = [helper.make_node("Gemm", gemm_in, ["y"], name="gemm", transB=trans_b)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])]
    if extra_use:
        nodes.append(helper.make_node("Transpose", ["w"], ["wt"], name="t"))
        outputs.append(helper.make_tensor_value_info("wt", TensorProto.FLOAT, [None, None]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                              outputs, inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _int4_weight() -> QuantizedWeight:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.1
    return QuantizedWeight("w", "rtn", int4.quantize_rtn(w, 64))


def test_weight_to_qdq_then_matmulnbits_keeps_the_outputs() -> None:
    q = _int4_weight()
    deq = q.data.dequantize().numpy()
    x = np.random.default_rng(0).standard_normal((7, K)).astype(np.float32)
    model = _gemm_model(deq.copy())
    (before,) = _run(model, {"x": x})
    g = R.Graph(model)
    assert R.WeightToQdq().check(g, q) is None
    dq = R.WeightToQdq().rewrite(g, q)
    g.commit()
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Gemm"]
    assert R.attr(dq, "block_size") == 64 and R.attr(dq, "axis") == 1
    assert "w" not in {t.name for t in model.graph.initializer}  # the float weight is gone
    (qdq,) = _run(model, {"x": x})
    np.testing.assert_allclose(qdq, before, rtol=1e-5, atol=1e-5)

    g = R.Graph(model)
    dq = g.nodes[0]
    rule = R.DqGemmToMatMulNBits()
    assert rule.check(g, dq) is None
    assert rule.rewrite(g, dq, {dq.input[0]: q.data}, accuracy_level=0) == 1
    g.commit()
    model.opset_import.append(helper.make_opsetid(R.MS_DOMAIN, 1))
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    (nbits,) = _run(model, {"x": x})
    np.testing.assert_allclose(nbits, before, rtol=1e-4, atol=1e-4)


def test_symmetric_int4_lowers_to_signed_int4_without_zero_point() -> None:
    """Symmetric INT4 (zero point 8): the QDQ form is signed int4 with no zero point (TensorRT's form),
    MatMulNBits keeps uint4 + zero point 8; both give the dequantized weight's outputs."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.1
    q = QuantizedWeight("w", "rtn", int4.quantize_rtn(w, 64, symmetric=True))
    assert q.data.symmetric and (q.data.zeros == 8).all()
    codes = q.data.codes.astype(np.int16) - 8
    assert codes.min() >= -8 and codes.max() <= 7
    deq = q.data.dequantize().numpy()
    # symmetric: the largest |w| of each group is representable to within half a step
    x = np.random.default_rng(0).standard_normal((7, K)).astype(np.float32)
    model = _gemm_model(deq.copy())
    (before,) = _run(model, {"x": x})
    g = R.Graph(model)
    dq = R.WeightToQdq(signed_int4=True).rewrite(g, q)
    g.commit()
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert len(dq.input) == 2 and types[dq.input[0]] == TensorProto.INT4
    (signed,) = _run(model, {"x": x})
    np.testing.assert_allclose(signed, before, rtol=1e-5, atol=1e-5)
    model = _gemm_model(deq.copy())
    g = R.Graph(model)
    dq = R.WeightToQdq().rewrite(g, q)  # the MatMulNBits path: uint4 + zero point 8
    assert types_of(model, g, dq) == (TensorProto.UINT4, TensorProto.UINT4)
    assert R.DqGemmToMatMulNBits().rewrite(g, dq, {dq.input[0]: q.data}, accuracy_level=0) == 1
    g.commit()
    model.opset_import.append(helper.make_opsetid(R.MS_DOMAIN, 1))
    (nbits,) = _run(model, {"x": x})
    np.testing.assert_allclose(nbits, before, rtol=1e-4, atol=1e-4)


def types_of(model: onnx.ModelProto, g: R.Graph, dq: onnx.NodeProto) -> tuple[int, int]:
    """Element types of a DequantizeLinear's codes and zero point (initializers not yet committed)."""
    return g.inits[dq.input[0]].data_type, g.inits[dq.input[2]].data_type


def test_float16_graphs_get_float16_scales_and_the_same_outputs() -> None:
    """The float16 targets (onnxruntime/cuda): DequantizeLinear and MatMulNBits scales in float16, so the
    types line up with the float16 activations; outputs as the float16 dequantized weight gives them."""
    q = _int4_weight()
    deq = q.data.dequantize().numpy().astype(np.float16)
    x = np.random.default_rng(0).standard_normal((7, K)).astype(np.float16)
    model = _gemm_model(deq.copy())
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    (before,) = _run(model, {"x": x})
    g = R.Graph(model)
    assert R.WeightToQdq().check(g, q) == "initializer is FLOAT16, not FLOAT"  # a float32 rule refuses it
    rule = R.WeightToQdq(np.float16)
    assert rule.check(g, q) is None
    dq = rule.rewrite(g, q)
    g.commit()
    assert {t.name: t.data_type for t in model.graph.initializer}[dq.input[1]] == TensorProto.FLOAT16
    (qdq,) = _run(model, {"x": x})
    np.testing.assert_allclose(qdq.astype(np.float32), before.astype(np.float32), rtol=2e-2, atol=2e-2)
    g = R.Graph(model)
    nbits = R.DqGemmToMatMulNBits(np.float16)
    assert nbits.rewrite(g, g.nodes[0], {dq.input[0]: q.data}, accuracy_level=0) == 1
    g.commit()
    model.opset_import.append(helper.make_opsetid(R.MS_DOMAIN, 1))
    assert {t.name: t.data_type for t in model.graph.initializer}[model.graph.node[0].input[2]] == TensorProto.FLOAT16
    (out,) = _run(model, {"x": x})
    np.testing.assert_allclose(out.astype(np.float32), before.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case,reason", [
    ("bias", "has alpha != 1 or a bias"),
    ("extra_use", "also feeds Transpose"),
    ("trans_b", "is not A x B^T"),
])
def test_dq_gemm_that_must_not_fuse_says_why(case: str, reason: str) -> None:
    q = _int4_weight()
    deq = q.data.dequantize().numpy()
    if case == "trans_b":  # a square weight read as B without transpose
        q = QuantizedWeight("w", "rtn", int4.quantize_rtn(torch.randn(K, K) * 0.1, 64))
        deq = q.data.dequantize().numpy()
    model = _gemm_model(deq, trans_b=0 if case == "trans_b" else 1, bias=case == "bias",
                        extra_use=case == "extra_use")
    g = R.Graph(model)
    dq = R.WeightToQdq().rewrite(g, q)
    why = R.DqGemmToMatMulNBits().check(g, dq)
    assert why is not None and reason in why, why


def test_weight_to_qdq_refuses_a_missing_or_mismatched_initializer() -> None:
    q = _int4_weight()
    g = R.Graph(_gemm_model(np.zeros((N, K + 1), np.float32)))
    assert "shape" in R.WeightToQdq().check(g, q)
    q.name = "nope"
    assert "no initializer" in R.WeightToQdq().check(g, q)


KVH, D, BS = 2, 4, 3


def _kv_model(shape_const: bool = True) -> onnx.ModelProto:
    """pool [nb, BS, KVH, D] -> Reshape [-1, D] -> Gather(rows) -> 'past'; x -> Identity -> 'new_key.0'."""
    inits = [numpy_helper.from_array(np.array([-1, D], np.int64), "shape")] if shape_const else []
    nodes = [
        helper.make_node("Reshape", ["key_cache.0", "shape" if shape_const else "dyn_shape"], ["rows"], name="r"),
        helper.make_node("Gather", ["rows", "idx"], ["past"], name="gather", axis=0),
        helper.make_node("Identity", ["x"], ["new_key.0"], name="id"),
    ]
    inputs = [helper.make_tensor_value_info("key_cache.0", TensorProto.FLOAT, [None, BS, KVH, D]),
              helper.make_tensor_value_info("idx", TensorProto.INT64, [None]),
              helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, KVH, D])]
    if not shape_const:
        inputs.append(helper.make_tensor_value_info("dyn_shape", TensorProto.INT64, [2]))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("past", TensorProto.FLOAT, [None, D]),
                               helper.make_tensor_value_info("new_key.0", TensorProto.FLOAT, [None, KVH, D])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("dtype", ["int8", pytest.param("float8_e4m3fn", marks=needs_ort("fp8_kv_cache"))])
def test_kv_cache_rewrite_reads_and_writes_per_head_quantized_rows(dtype: str) -> None:
    scales = np.array([0.05, 0.2], np.float32)
    kv = KvCacheQuant(dtype, scales[None], scales[None])  # type: ignore[arg-type]
    model = _kv_model()
    g = R.Graph(model)
    rule = R.KvCacheQdq(kv)
    assert rule.check_input(g, "key_cache.0", D) is None
    rule.rewrite_input(g, "key_cache.0", scales)
    rule.rewrite_output(g, "new_key.0", scales)
    in_t, out_t = rule.onnx_dtypes()
    R.set_elem_type(model.graph.input, {"key_cache.0"}, in_t)
    R.set_elem_type(model.graph.output, {"new_key.0"}, out_t)
    g.commit()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, KVH, D)) * 3).astype(np.float32)
    feeds = {"key_cache.0": np.zeros((1, BS, KVH, D), np.int8 if dtype == "int8" else np.uint8),
             "idx": np.array([0], np.int64), "x": x}
    _, new = _run(model, feeds)
    assert new.dtype == (np.int8 if dtype == "int8" else np.uint8)  # E4M3 bits come back as uint8
    if dtype == "int8":
        expect = np.clip(np.rint(x / scales[None, :, None]), -128, 127).astype(np.int8)
        decoded = new.astype(np.float32) * scales[None, :, None]
    else:
        expect = (x / scales[None, :, None]).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        decoded = new.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scales[None, :, None]
    np.testing.assert_array_equal(new, expect)
    # the new K/V go into the pool; reading rows back dequantizes each with its head's scale
    pool = np.zeros((2, BS, KVH, D), new.dtype)
    pool.reshape(-1, KVH, D)[:5] = new
    rows = np.array([0, 1, 2, 3, 9, 4], np.int64)  # row r holds head r % KVH
    past, _ = _run(model, {**feeds, "key_cache.0": pool, "idx": rows})
    np.testing.assert_allclose(past, decoded.reshape(-1, D)[rows], rtol=1e-6, atol=1e-7)


def test_kv_cache_rewrite_refuses_an_unknown_read_pattern() -> None:
    g = R.Graph(_kv_model(shape_const=False))
    kv = KvCacheQuant("int8", np.ones((1, KVH), np.float32), np.ones((1, KVH), np.float32))
    why = R.KvCacheQdq(kv).check_input(g, "key_cache.0", D)
    assert why is not None and "not to a constant" in why


@needs_ort("fp8_activations")
def test_fp8_activation_qdq_is_shared_by_gemms_reading_one_input_in_any_order() -> None:
    """q/k/v read one tensor: one Q/DQ pair, placed before all of them whatever order they are rewritten in."""
    from compiler.quant import fp8

    rng = np.random.default_rng(0)
    ws = {n: rng.standard_normal((8, 16)).astype(np.float32) for n in ("b_w", "a_w")}
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="relu")]
    nodes += [helper.make_node("Gemm", ["h", n], [f"y_{n}"], name=f"gemm_{n}", transB=1) for n in ws]  # b_w first
    model = make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 16])],
        [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, [None, 8]) for n in ws],
        [numpy_helper.from_array(w, n) for n, w in ws.items()]), opset_imports=[helper.make_opsetid("", 21)])
    g = R.Graph(model)
    shared: dict = {}
    pairs = 0
    for n in sorted(ws):  # a_w (the second Gemm) is rewritten first
        q = QuantizedWeight(n, "fp8", fp8.quantize_weight(torch.from_numpy(ws[n])), act_mode="static",
                            act_scale=fp8.activation_scale(4.0))
        dq = R.WeightToQdq().rewrite(g, q)
        pairs += R.ActivationQdq().rewrite(g, q, dq.output[0], shared)
    g.commit()
    assert pairs == 1 and [n.op_type for n in model.graph.node].count("QuantizeLinear") == 1
    outs = _run(model, {"x": rng.standard_normal((3, 16)).astype(np.float32)})
    assert all(np.isfinite(o).all() for o in outs)
