"""ONNX rewrites that write quantization into the lowered graph (STYLE 8: each rule has a check that
returns a reason when it does not apply, and the pass reports how often each fired).

- `WeightToQdq`       a quantized weight initializer W -> DequantizeLinear(W_q, scale[, zero_point]):
                      INT4 as uint4 with block_size along the input axis (opset 21), FP8 as
                      float8e4m3fn per output channel or per tensor. Consumers are unchanged: DQ
                      yields exactly the dequantized weights our torch model holds.
- `ActivationQdq`     FP8 activations: QuantizeLinear/DequantizeLinear on the A input of a Gemm whose
                      B is an FP8 DQ (static per-tensor scale, or per-token scale computed in the graph)
- `DqGemmToMatMulNBits`  DQ(uint4, axis 1, block) + Gemm(transB=1) -> com.microsoft.MatMulNBits
- `DqGemmToInt8`      DQ(int8, axis 0) + Gemm(transB=1) -> ONNX Runtime's integer GEMM with the input
                      quantized at run time (per token or per tensor), one quantization per input
- `KvCacheQdq`        the KV pool inputs become int8 (QDQ per head) or uint8 holding E4M3 bits
                      (decoded by a 256-entry table: ONNX Gather does not take float8), and the
                      new K/V outputs QuantizeLinear per head

`Graph` is a small mutable view over a GraphProto (node list, producers, consumers, initializers);
`Graph.commit()` writes it back and drops initializers and value_info that nothing uses any more.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler import streamed
from compiler.quant.fp8 import E4M3_MAX, Fp8Weight
from compiler.quant.int4 import SYMMETRIC_ZERO, Int4Weight, pack_matmulnbits
from compiler.quant.int8 import ACT_ZERO_POINT, MIN_SCALE, QMAX, Int8Weight
from compiler.quant.state import KvCacheQuant, QuantizedWeight
from compiler.streamed import Deferred

MS_DOMAIN = "com.microsoft"


class Graph:
    """Mutable view of a GraphProto for rewrites."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.nodes: list[onnx.NodeProto] = list(g.node)
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self._names: set[str] = set()

    def producer(self, name: str) -> onnx.NodeProto | None:
        for n in self.nodes:
            if name in n.output:
                return n
        return None

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return [n for n in self.nodes if name in n.input]

    def index(self, node: onnx.NodeProto) -> int:
        for i, n in enumerate(self.nodes):
            if n is node:
                return i
        raise KeyError(node.name)

    def insert_before(self, anchor: onnx.NodeProto, new: Iterable[onnx.NodeProto]) -> None:
        i = self.index(anchor)
        self.nodes[i:i] = list(new)

    def insert_after(self, anchor: onnx.NodeProto, new: Iterable[onnx.NodeProto]) -> None:
        i = self.index(anchor) + 1
        self.nodes[i:i] = list(new)

    def add_init(self, tensor: onnx.TensorProto) -> str:
        self.inits[tensor.name] = tensor
        return tensor.name

    def unique(self, base: str) -> str:
        """A tensor/node name not used yet (deterministic: base, base_1, ...)."""
        if not self._names:
            g = self.model.graph
            self._names = {i.name for i in g.input} | {o.name for o in g.output} | set(self.inits)
            for n in self.nodes:
                self._names.update(n.input)
                self._names.update(n.output)
                self._names.add(n.name)
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def rename_uses(self, old: str, new: str, except_node: onnx.NodeProto | None = None) -> None:
        for n in self.nodes:
            if n is except_node:
                continue
            for i, x in enumerate(n.input):
                if x == old:
                    n.input[i] = new

    def commit(self) -> None:
        g = self.model.graph
        used = {x for n in self.nodes for x in n.input} | {o.name for o in g.output}
        produced = {x for n in self.nodes for x in n.output} | {i.name for i in g.input}
        del g.node[:]
        g.node.extend(self.nodes)
        keep = [t for name, t in self.inits.items() if name in used]
        del g.initializer[:]
        g.initializer.extend(sorted(keep, key=lambda t: t.name))
        live = used | produced
        vis = [v for v in g.value_info if v.name in live and v.name not in self.inits]
        vis += [v for v in g.value_info if v.name in self.inits and v.name in used]
        seen: set[str] = set()
        del g.value_info[:]
        for v in vis:
            if v.name not in seen:
                seen.add(v.name)
                g.value_info.append(v)

    def drop_value_info(self, names: Iterable[str]) -> None:
        names = set(names)
        keep = [v for v in self.model.graph.value_info if v.name not in names]
        del self.model.graph.value_info[:]
        self.model.graph.value_info.extend(keep)


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _tensor(array: np.ndarray | Deferred, name: str) -> onnx.TensorProto:
    return streamed.tensor(array, name)


# ------------------------------------------------------------------------------ weights


@dataclass
class RuleResult:
    fired: int = 0
    reasons: dict[str, str] | None = None  # what did not match and why

    def miss(self, what: str, why: str) -> None:
        if self.reasons is None:
            self.reasons = {}
        self.reasons[what] = why


# the graph float types lowering stores scales in (numpy has no bfloat16: ml_dtypes', which onnx uses)
FLOAT_TYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_ONNX_FLOAT = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16}


def torch_to_numpy(t: Any, dtype: Any) -> np.ndarray:
    """A torch tensor cast to `dtype` as a numpy array (bfloat16 through its bits, as ml_dtypes.bfloat16)."""
    import torch

    t = t.to(dtype).contiguous()
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class WeightToQdq:
    """Quantized weight initializer -> DequantizeLinear from its stored (INT4 / FP8) form.

    `float_type` is the graph's float element type (float32, or float16/bfloat16 for those targets): the
    scales are stored in it, so DequantizeLinear yields what the initializer held."""

    def __init__(self, float_type: type = np.float32, signed_int4: bool = False) -> None:
        self.float_type = np.dtype(float_type)
        self.signed_int4 = signed_int4  # symmetric INT4 as signed int4 without zero point (the QDQ form)

    def check(self, g: Graph, q: QuantizedWeight) -> str | None:
        init = g.inits.get(q.name)
        if init is None:
            return "no initializer of that name in the lowered graph"
        if tuple(init.dims) != q.data.shape:
            return f"initializer shape {tuple(init.dims)} != quantized {q.data.shape}"
        want = _ONNX_FLOAT[self.float_type]
        if init.data_type != want:
            return (f"initializer is {TensorProto.DataType.Name(init.data_type)}, not "
                    f"{TensorProto.DataType.Name(want)}")
        if not g.consumers(q.name):
            return "nothing reads the initializer"
        return None

    def rewrite(self, g: Graph, q: QuantizedWeight) -> onnx.NodeProto:
        base = q.name
        out = g.unique(f"{base}_dequantized")
        d = q.data
        if isinstance(d, Int4Weight) and d.symmetric and self.signed_int4:
            def to_signed(codes: np.ndarray) -> np.ndarray:
                return (codes.astype(np.int8) - SYMMETRIC_ZERO).astype(ml_dtypes.int4)

            signed = (d.codes.map(to_signed, d.codes.shape, ml_dtypes.int4) if isinstance(d.codes, Deferred)
                      else to_signed(d.codes))
            inputs = [
                g.add_init(_tensor(signed, g.unique(f"{base}_quantized"))),
                g.add_init(_tensor(d.scales.astype(self.float_type), g.unique(f"{base}_scale"))),
            ]
            node = helper.make_node("DequantizeLinear", inputs, [out], name=g.unique(f"{base}_DequantizeLinear"),
                                    axis=1, block_size=d.group_size)
        elif isinstance(d, Int4Weight):
            inputs = [
                g.add_init(_tensor(d.codes.astype(ml_dtypes.uint4), g.unique(f"{base}_quantized"))),
                g.add_init(_tensor(d.scales.astype(self.float_type), g.unique(f"{base}_scale"))),
                g.add_init(_tensor(d.zeros.astype(ml_dtypes.uint4), g.unique(f"{base}_zero_point"))),
            ]
            node = helper.make_node("DequantizeLinear", inputs, [out], name=g.unique(f"{base}_DequantizeLinear"),
                                    axis=1, block_size=d.group_size)
        elif isinstance(d, Int8Weight):
            inputs = [
                g.add_init(_tensor(d.codes, g.unique(f"{base}_quantized"))),
                g.add_init(_tensor(d.scales.astype(self.float_type), g.unique(f"{base}_scale"))),
            ]
            node = helper.make_node("DequantizeLinear", inputs, [out], name=g.unique(f"{base}_DequantizeLinear"), axis=0)
        elif isinstance(d, Fp8Weight):
            e4m3 = ml_dtypes.float8_e4m3fn
            codes = (d.codes.map(lambda c: c.view(e4m3), d.codes.shape, e4m3) if isinstance(d.codes, Deferred)
                     else d.codes.view(e4m3))
            inputs = [
                g.add_init(_tensor(codes, g.unique(f"{base}_quantized"))),
                g.add_init(_tensor(d.scales.astype(self.float_type), g.unique(f"{base}_scale"))),
            ]
            kw = {"axis": 0} if d.scales.ndim == 1 else {}
            node = helper.make_node("DequantizeLinear", inputs, [out], name=g.unique(f"{base}_DequantizeLinear"), **kw)
        else:  # pragma: no cover
            raise TypeError(type(d))
        g.rename_uses(q.name, out)
        g.nodes.insert(0, node)  # reads initializers only
        return node


class ActivationQdq:
    """FP8 activations: Q/DQ on the A input of each Gemm that reads an FP8 weight's DequantizeLinear
    (scales and constants in the graph's float type)."""

    def __init__(self, float_type: type = np.float32) -> None:
        self.float_type = np.dtype(float_type)

    def check(self, g: Graph, q: QuantizedWeight, dq_out: str) -> str | None:
        gemms = [n for n in g.consumers(dq_out) if n.op_type == "Gemm" and list(n.input[1:2]) == [dq_out]]
        if not gemms:
            return "the dequantized weight feeds no Gemm as B (activation quantization applies to Linear inputs)"
        return None

    def rewrite(self, g: Graph, q: QuantizedWeight, dq_out: str, shared: dict[tuple[str, float], str]) -> int:
        n_new = 0
        for gemm in [n for n in g.consumers(dq_out) if n.op_type == "Gemm" and n.input[1] == dq_out]:
            x = gemm.input[0]
            key = (x, q.act_scale if q.act_mode == "static" else -1.0)
            if key not in shared:
                shared[key] = self._qdq(g, x, q, self.float_type)
                n_new += 1
            gemm.input[0] = shared[key]
        return n_new

    @staticmethod
    def _qdq(g: Graph, x: str, q: QuantizedWeight, ft: np.dtype) -> str:
        base = x
        zp = ""
        if q.act_mode == "static":
            zp = g.add_init(_tensor(np.zeros((), ml_dtypes.float8_e4m3fn), g.unique(f"{base}_fp8_zero_point")))
        xq, xd = g.unique(f"{base}_fp8"), g.unique(f"{base}_fp8_dequantized")
        nodes: list[onnx.NodeProto] = []
        kw: dict[str, int] = {}
        if q.act_mode == "static":
            scale = g.add_init(_tensor(np.array(q.act_scale, ft), g.unique(f"{base}_fp8_scale")))
        else:  # dynamic per token: scale[t] = max(amax(|x[t, :]|) / 448, tiny)
            ab, am, sc = g.unique(f"{base}_abs"), g.unique(f"{base}_amax"), g.unique(f"{base}_fp8_scale")
            axes = g.add_init(_tensor(np.array([1], np.int64), g.unique(f"{base}_axes")))
            div = g.add_init(_tensor(np.array(E4M3_MAX, ft), g.unique(f"{base}_e4m3_max")))
            tiny = g.add_init(_tensor(np.array(1e-12 if ft == np.float32 else 1e-7, ft), g.unique(f"{base}_min_scale")))
            sd = g.unique(f"{base}_scaled")
            nodes += [
                helper.make_node("Abs", [x], [ab], name=g.unique(f"{base}_Abs")),
                helper.make_node("ReduceMax", [ab, axes], [am], name=g.unique(f"{base}_ReduceMax"), keepdims=0),
                helper.make_node("Div", [am, div], [sd], name=g.unique(f"{base}_Div")),
                helper.make_node("Max", [sd, tiny], [sc], name=g.unique(f"{base}_Max")),
            ]
            scale = sc
            kw = {"axis": 0}
        if q.act_mode == "static":
            q_in, dq_in = [x, scale, zp], [xq, scale, zp]
        else:  # a per-axis zero point would need the (dynamic) token count: give the type instead
            q_in, dq_in = [x, scale], [xq, scale]
            kw["output_dtype"] = TensorProto.FLOAT8E4M3FN
        nodes += [
            helper.make_node("QuantizeLinear", q_in, [xq], name=g.unique(f"{base}_QuantizeLinear"), saturate=1, **kw),
            helper.make_node("DequantizeLinear", dq_in, [xd], name=g.unique(f"{base}_DequantizeLinear"),
                             **{k: v for k, v in kw.items() if k == "axis"}),
        ]
        producer = g.producer(x)  # right after x exists: every Gemm reading x (q/k/v share it) comes later
        if producer is None:
            g.nodes[0:0] = nodes
        else:
            g.insert_after(producer, nodes)
        return xd


class DqGemmToMatMulNBits:
    """DequantizeLinear(uint4, axis=1, block_size) feeding Gemm(transB=1) as B -> MatMulNBits (its scales
    in the graph's float type: MatMulNBits takes them in A's type)."""

    def __init__(self, float_type: type = np.float32) -> None:
        self.float_type = np.dtype(float_type)

    def check(self, g: Graph, dq: onnx.NodeProto) -> str | None:
        if dq.op_type != "DequantizeLinear":
            return "not a DequantizeLinear"
        w = g.inits.get(dq.input[0])
        if w is None or w.data_type != TensorProto.UINT4:
            return "input is not a uint4 initializer"
        if len(dq.input) < 3 or dq.input[2] not in g.inits:
            return "no constant zero point"
        if attr(dq, "axis", 1) != 1 or not attr(dq, "block_size", 0):
            return "not blocked along axis 1"
        bs = attr(dq, "block_size")
        if bs < 16 or bs & (bs - 1):
            return f"block_size {bs} is not a power of two >= 16"
        users = g.consumers(dq.output[0])
        for u in users:
            if u.op_type != "Gemm" or list(u.input[1:2]) != [dq.output[0]]:
                return f"the dequantized weight also feeds {u.op_type} {u.name!r}"
            if attr(u, "transB", 0) != 1 or attr(u, "transA", 0) != 0:
                return f"Gemm {u.name!r} is not A x B^T"
            if abs(attr(u, "alpha", 1.0) - 1.0) > 0 or (len(u.input) > 2 and u.input[2]):
                return f"Gemm {u.name!r} has alpha != 1 or a bias"
        if not users:
            return "nothing reads the dequantized weight"
        return None

    def rewrite(self, g: Graph, dq: onnx.NodeProto, weights: dict[str, Int4Weight], accuracy_level: int) -> int:
        q = weights[dq.input[0]]
        n, k = q.shape
        b, s, z = pack_matmulnbits(q)
        base = dq.input[0].removesuffix("_quantized")
        ins = [g.add_init(_tensor(b, g.unique(f"{base}_nbits"))),
               g.add_init(_tensor(s.astype(self.float_type), g.unique(f"{base}_nbits_scales")))]
        # symmetric INT4 (every zero point 8) leaves the zero points out: 8 is MatMulNBits' default, and MLAS
        # then runs its kernels without zero points: llama-110m's projections at M = 1, 2 threads (AVX-512
        # VNNI, accuracy_level 4), 4-6% faster per node
        if not q.symmetric:
            ins.append(g.add_init(_tensor(z, g.unique(f"{base}_nbits_zero_points"))))
        fired = 0
        for u in g.consumers(dq.output[0]):
            node = helper.make_node("MatMulNBits", [u.input[0], *ins], list(u.output), name=g.unique(f"{u.name}_nbits"),
                                    domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=q.group_size,
                                    accuracy_level=accuracy_level)
            g.nodes[g.index(u)] = node
            fired += 1
        g.nodes.remove(dq)
        return fired


# the integer GEMM forms lower_quant can write for int8 weights (per activation mode)
INT8_OPS: dict[str, tuple[str, ...]] = {
    "per_token": ("MatMulIntegerToFloat", "MatMulInteger"),
    "per_tensor": ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger"),
}


class DqGemmToInt8:
    """DequantizeLinear(int8 [N, K], per-row scale, axis 0) feeding Gemm(transB=1) as B -> an integer GEMM
    of ONNX Runtime with the A input quantized to uint8 at run time.

    The weight is stored transposed ([K, N] int8, what the integer ops take). `op`:
    - DynamicQuantizeMatMul (com.microsoft, per tensor only): one node per Linear, quantizes its own input;
    - MatMulIntegerToFloat (com.microsoft): int32 accumulation times a_scale * b_scale[n] (+ bias) in the kernel;
    - MatMulInteger (ONNX): int32 output, then Cast and Mul by the scales (+ Add of the bias).
    The input is quantized once per tensor and shared by the Linears that read it (q/k/v, gate/up):
    per tensor with DynamicQuantizeLinear; per token as Abs, ReduceMax, Mul(1/127), Max(tiny) -> s [T, 1],
    then QuantizeLinear(x / s, 1, 128) -> uint8 (integer values in [-127, 127] around zero point 128),
    and the GEMM's output is multiplied by s.
    """

    def __init__(self, op: str, activations: str) -> None:
        if op not in INT8_OPS[activations]:
            raise ValueError(f"int8 op {op!r} does not take {activations} activations; "
                             f"use one of {', '.join(INT8_OPS[activations])}")
        self.op = op
        self.activations = activations
        self._quantized: dict[str, tuple[str, str, str]] = {}  # input -> (codes, scale, zero point)
        self._consts: dict[str, str] = {}

    def check(self, g: Graph, dq: onnx.NodeProto) -> str | None:
        if dq.op_type != "DequantizeLinear":
            return "not a DequantizeLinear"
        w = g.inits.get(dq.input[0])
        if w is None or w.data_type != TensorProto.INT8:
            return "input is not an int8 initializer"
        if len(dq.input) > 2 and dq.input[2]:
            return "has a zero point (int8 weights here are symmetric)"
        if attr(dq, "axis", 1) != 0 or attr(dq, "block_size", 0):
            return "not per output channel (axis 0)"
        users = g.consumers(dq.output[0])
        if not users:
            return "nothing reads the dequantized weight"
        for u in users:
            if u.op_type != "Gemm" or list(u.input[1:2]) != [dq.output[0]]:
                return f"the dequantized weight also feeds {u.op_type} {u.name!r}"
            if attr(u, "transB", 0) != 1 or attr(u, "transA", 0) != 0 or abs(attr(u, "alpha", 1.0) - 1.0) > 0:
                return f"Gemm {u.name!r} is not A x B^T"
            if len(u.input) > 2 and u.input[2] and (u.input[2] not in g.inits or abs(attr(u, "beta", 1.0) - 1.0) > 0):
                return f"Gemm {u.name!r} has a bias that is not a constant added once"
        return None

    @property
    def quantized_inputs(self) -> int:
        """Distinct tensors quantized so far (0 for DynamicQuantizeMatMul, which quantizes inside each node)."""
        return len(self._quantized)

    def _const(self, g: Graph, key: str, value: np.ndarray) -> str:
        if key not in self._consts:
            self._consts[key] = g.add_init(_tensor(value, g.unique(key)))
        return self._consts[key]

    def _quantize_input(self, g: Graph, x: str) -> tuple[str, str, str]:
        """(uint8 codes, scale, zero point) of tensor x, written once right after x is produced."""
        if x in self._quantized:
            return self._quantized[x]
        nodes: list[onnx.NodeProto] = []
        if self.activations == "per_tensor":
            xq, sc, zp = g.unique(f"{x}_int8"), g.unique(f"{x}_int8_scale"), g.unique(f"{x}_int8_zero_point")
            nodes.append(helper.make_node("DynamicQuantizeLinear", [x], [xq, sc, zp],
                                          name=g.unique(f"{x}_DynamicQuantizeLinear")))
        else:
            axes = self._const(g, "int8_reduce_axes", np.array([-1], np.int64))
            inv = self._const(g, "int8_inv_qmax", np.array(1.0 / QMAX, np.float32))
            tiny = self._const(g, "int8_min_scale", np.array(MIN_SCALE, np.float32))
            one = self._const(g, "int8_unit_scale", np.array(1.0, np.float32))
            zp = self._const(g, "int8_act_zero_point", np.array(ACT_ZERO_POINT, np.uint8))
            ab, am, sd, sc = (g.unique(f"{x}_{s}") for s in ("abs", "amax", "amax_scaled", "int8_scale"))
            xs, xq = g.unique(f"{x}_scaled"), g.unique(f"{x}_int8")
            nodes += [
                helper.make_node("Abs", [x], [ab], name=g.unique(f"{x}_Abs")),
                helper.make_node("ReduceMax", [ab, axes], [am], name=g.unique(f"{x}_ReduceMax"), keepdims=1),
                helper.make_node("Mul", [am, inv], [sd], name=g.unique(f"{x}_MulInvQmax")),
                helper.make_node("Max", [sd, tiny], [sc], name=g.unique(f"{x}_MaxTiny")),
                helper.make_node("Div", [x, sc], [xs], name=g.unique(f"{x}_DivScale")),
                helper.make_node("QuantizeLinear", [xs, one, zp], [xq], name=g.unique(f"{x}_QuantizeLinear")),
            ]
        producer = g.producer(x)  # right after x exists: every Gemm reading x comes later
        if producer is None:
            g.nodes[0:0] = nodes
        else:
            g.insert_after(producer, nodes)
        self._quantized[x] = (xq, sc, zp)
        return self._quantized[x]

    def rewrite(self, g: Graph, dq: onnx.NodeProto, w: Int8Weight) -> int:
        base = dq.input[0].removesuffix("_quantized")
        n, k = w.shape
        kn = (w.codes.map(lambda c: np.ascontiguousarray(c.T), (k, n), np.int8) if isinstance(w.codes, Deferred)
              else np.ascontiguousarray(w.codes.T))  # a streamed weight: transposed when written
        wt = g.add_init(_tensor(kn, g.unique(f"{base}_int8_kn")))
        bs = g.add_init(_tensor(w.scales.astype(np.float32), g.unique(f"{base}_int8_scale")))
        fired = 0
        for u in g.consumers(dq.output[0]):
            x, out = u.input[0], u.output[0]
            bias = u.input[2] if len(u.input) > 2 and u.input[2] else ""
            name = g.unique(f"{u.name}_int8")
            new: list[onnx.NodeProto] = []
            if self.op == "DynamicQuantizeMatMul":
                new.append(helper.make_node("DynamicQuantizeMatMul", [x, wt, bs, "", bias] if bias else [x, wt, bs],
                                            [out], name=name, domain=MS_DOMAIN))
            else:
                xq, sc, zp = self._quantize_input(g, x)
                per_tensor = self.activations == "per_tensor"
                y = g.unique(f"{out}_int8_out")
                if self.op == "MatMulIntegerToFloat":
                    a_scale = sc if per_tensor else self._consts["int8_unit_scale"]
                    ins = [xq, wt, a_scale, bs, zp] + (["", bias] if bias and per_tensor else [])
                    new.append(helper.make_node("MatMulIntegerToFloat", ins, [y], name=name, domain=MS_DOMAIN))
                    if not per_tensor:  # the per-token scales multiply the kernel's output rows
                        y2 = g.unique(f"{out}_int8_rows")
                        new.append(helper.make_node("Mul", [y, sc], [y2], name=g.unique(f"{name}_RowScale")))
                        y = y2
                    else:
                        bias = ""  # added by the kernel
                else:
                    acc, accf, s = g.unique(f"{out}_int32"), g.unique(f"{out}_int32_float"), g.unique(f"{out}_scale")
                    new += [helper.make_node("MatMulInteger", [xq, wt, zp], [acc], name=name),
                            helper.make_node("Cast", [acc], [accf], name=g.unique(f"{name}_Cast"), to=TensorProto.FLOAT)]
                    if per_tensor:  # ONNX Runtime fuses this pattern into MatMulIntegerToFloat
                        new += [helper.make_node("Mul", [sc, bs], [s], name=g.unique(f"{name}_Scales")),
                                helper.make_node("Mul", [accf, s], [y], name=g.unique(f"{name}_Mul"))]
                    else:  # rows, then columns: ONNX Runtime 1.32's fusion of Mul(row x column scales) + bias
                        #     Add into MatMulIntegerToFloat takes the [T, 1] row scales as per-column (wrong)
                        new += [helper.make_node("Mul", [accf, sc], [s], name=g.unique(f"{name}_RowScale")),
                                helper.make_node("Mul", [s, bs], [y], name=g.unique(f"{name}_Mul"))]
                if bias:
                    new.append(helper.make_node("Add", [y, bias], [out], name=g.unique(f"{name}_Bias")))
                else:
                    new[-1].output[0] = out
            i = g.index(u)
            g.nodes[i:i + 1] = new
            fired += 1
        g.nodes.remove(dq)
        return fired


# ------------------------------------------------------------------------------ KV cache


def e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 E4M3 bit patterns (NaN patterns -> 0)."""
    t = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.nan_to_num(t, nan=0.0)


class KvCacheQdq:
    """Quantized KV pools: read path Reshape -> Gather(rows) -> dequantize per head; write path Q per head.

    The pool [num_blocks, block_size, kv_heads, head_dim] is read as rows of head_dim (Reshape to
    [-1, head_dim], then Gather of row indices); row r holds head r % kv_heads, so each gathered row
    is scaled by its head's scale (DequantizeLinear per row for int8; an E4M3 decode table times the
    scale for FP8, stored as uint8 because ONNX Gather takes no float8). One instance per graph: the
    row -> head index and the decode table are shared by every layer.
    """

    def __init__(self, kv: KvCacheQuant) -> None:
        self.kv = kv
        self._head_index: dict[str, str] = {}  # row-index tensor -> its head-index tensor
        self._table: str | None = None

    def check_input(self, g: Graph, name: str, head_dim: int) -> str | None:
        users = g.consumers(name)
        if len(users) != 1 or users[0].op_type != "Reshape":
            return f"{name} is not read by exactly one Reshape"
        shape = g.inits.get(users[0].input[1])
        if shape is None or numpy_helper.to_array(shape).tolist() != [-1, head_dim]:
            return f"the Reshape of {name} is not to a constant [-1, {head_dim}]"
        gathers = g.consumers(users[0].output[0])
        if len(gathers) != 1 or gathers[0].op_type != "Gather" or attr(gathers[0], "axis", 0) != 0 \
                or gathers[0].input[0] != users[0].output[0]:
            return f"the rows of {name} are not read by exactly one Gather on axis 0"
        return None

    def rewrite_input(self, g: Graph, name: str, scales: np.ndarray) -> None:
        reshape = g.consumers(name)[0]
        gather = g.consumers(reshape.output[0])[0]
        idx = gather.input[1]
        new: list[onnx.NodeProto] = []
        if idx not in self._head_index:
            mod = g.add_init(_tensor(np.array(scales.shape[0], np.int64), g.unique("kv_heads")))
            self._head_index[idx] = g.unique(f"{idx}_head")
            new.append(helper.make_node("Mod", [idx, mod], [self._head_index[idx]], name=g.unique(f"{idx}_Mod")))
        sc = g.add_init(_tensor(scales.astype(np.float32), g.unique(f"{name}_scale")))
        row_scale = g.unique(f"{name}_row_scale")
        new.append(helper.make_node("Gather", [sc, self._head_index[idx]], [row_scale],
                                    name=g.unique(f"{name}_GatherScale"), axis=0))
        out = gather.output[0]
        raw = g.unique(f"{out}_quantized")
        gather.output[0] = raw
        g.drop_value_info([reshape.output[0], out])  # their element type changes (or the name moves)
        if self.kv.dtype == "int8":
            new.append(helper.make_node("DequantizeLinear", [raw, row_scale], [out],
                                        name=g.unique(f"{name}_DequantizeLinear"), axis=0))
        else:
            if self._table is None:
                self._table = g.add_init(_tensor(e4m3_table(), g.unique("e4m3_decode_table")))
            as_idx, dec, col = g.unique(f"{raw}_index"), g.unique(f"{raw}_decoded"), g.unique(f"{row_scale}_column")
            one = g.add_init(_tensor(np.array([1], np.int64), g.unique(f"{name}_axis1")))
            new += [
                helper.make_node("Cast", [raw], [as_idx], name=g.unique(f"{name}_Cast"), to=TensorProto.INT32),
                helper.make_node("Gather", [self._table, as_idx], [dec], name=g.unique(f"{name}_Decode"), axis=0),
                helper.make_node("Unsqueeze", [row_scale, one], [col], name=g.unique(f"{name}_Unsqueeze")),
                helper.make_node("Mul", [dec, col], [out], name=g.unique(f"{name}_Mul")),
            ]
        g.insert_after(gather, new)

    def rewrite_output(self, g: Graph, name: str, scales: np.ndarray) -> None:
        prod = g.producer(name)
        if prod is None:
            raise ValueError(f"graph output {name} has no producer")
        flt = g.unique(f"{name}_float")
        prod.output[list(prod.output).index(name)] = flt
        g.rename_uses(name, flt)
        int8 = self.kv.dtype == "int8"
        sc = g.add_init(_tensor(scales.astype(np.float32), g.unique(f"{name}_scale")))
        zp = g.add_init(_tensor(np.zeros(scales.shape, np.int8 if int8 else ml_dtypes.float8_e4m3fn),
                                g.unique(f"{name}_zero_point")))
        kw = {} if int8 else {"saturate": 1}
        g.nodes.append(helper.make_node("QuantizeLinear", [flt, sc, zp], [name],
                                        name=g.unique(f"{name}_QuantizeLinear"), axis=1, **kw))

    def onnx_dtypes(self) -> tuple[int, int]:
        """(pool input element type, new K/V output element type)."""
        if self.kv.dtype == "int8":
            return TensorProto.INT8, TensorProto.INT8
        return TensorProto.UINT8, TensorProto.FLOAT8E4M3FN


def set_elem_type(values: Iterable[onnx.ValueInfoProto], names: set[str], elem: int) -> int:
    n = 0
    for v in values:
        if v.name in names:
            v.type.tensor_type.elem_type = elem
            n += 1
    return n
