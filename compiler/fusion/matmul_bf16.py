"""Weight products in bfloat16: float MatMul / Gemm with a constant weight -> optimize.MatMulBf16.

Opt-in through the recipe's `target.matmul: bfloat16` (onnxruntime/cpu, float32): the `fuse` pass runs
this rule after the others. Every float32 MatMul whose second input is a constant [K, N] matrix, and
every Gemm (alpha 1, transA 0) with a constant B ([K, N], or [N, K] with transB), becomes
`optimize.MatMulBf16(a, w, n=N)` of the package's C library (runtime/kernels/op_matmul_bf16.c); a
Gemm's bias C stays as an Add after it. The weight is stored once in bfloat16 (round to nearest even),
packed as the kernel reads it: [ceil(N / 16), ceil(K / 2), 16, 2], panels of 16 columns with each
column's K values in pairs, zeros padding N and K. The kernel rounds the activations to bfloat16 as well
and sums the products in float32 (AVX-512 BF16's vdpbf16ps where the CPU has it, float32 FMA on the same
bf16 values elsewhere).

What it changes: the weights' bytes halve (the decode steps stream half as much memory), and a CPU with
AVX-512 BF16 multiplies twice as fast as in float32; the numbers move by bfloat16's rounding of both
operands (8 significant bits), which the build's quality gate measures against the float32 model like a
quantization. Norms, attention, rotary, softmax and the residual stream stay float32; integer (MatMulNBits,
MatMulIntegerToFloat) nodes are not touched.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from compiler.fusion.graph import FusionGraph, RuleReport, attr

DOMAIN = "optimize"
OP_TYPE = "MatMulBf16"
PANEL = 16  # columns per packed panel (one AVX-512 register of float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest, ties to even; NaNs stay NaNs."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def pack_bf16(w: np.ndarray) -> np.ndarray:
    """W [K, N] float32 -> the kernel's layout, uint16 bf16 bits [ceil(N/16), ceil(K/2), 16, 2]."""
    k, n = w.shape
    kp, np_ = -(-k // 2), -(-n // PANEL)
    padded = np.zeros((2 * kp, PANEL * np_), np.float32)
    padded[:k, :n] = w
    bits = bf16_bits(padded)  # [2*KP, 16*NP]
    return np.ascontiguousarray(bits.reshape(kp, 2, np_, PANEL).transpose(2, 0, 3, 1))


def unpack_bf16(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    """The packed weight back as float32 [K, N] (the bf16 values the kernel multiplies with)."""
    np_, kp = packed.shape[:2]
    return bf16_to_float32(packed.transpose(1, 3, 0, 2).reshape(2 * kp, PANEL * np_))[:k, :n]


def reference_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What the kernel computes, in float64: bf16(a) @ bf16(w)."""
    return bf16_to_float32(bf16_bits(a)).astype(np.float64) @ bf16_to_float32(bf16_bits(w)).astype(np.float64)


def _bf16_tensor(bits: np.ndarray, name: str) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(bits.shape))
    t.raw_data = np.ascontiguousarray(bits, np.uint16).tobytes()
    return t


def _weight(g: FusionGraph, node: onnx.NodeProto) -> tuple[np.ndarray, str | None] | str | None:
    """(W [K, N], bias name or None) when `node` can take the kernel; a reason when it cannot; None when
    it is not a candidate at all (no constant float weight)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
        return None
    init = g.inits.get(node.input[1])
    if init is None or init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
        return None
    from onnx import numpy_helper

    w = numpy_helper.to_array(init)
    if node.op_type == "MatMul":
        return w, None
    if attr(node, "alpha", 1.0) != 1.0 or attr(node, "transA", 0) != 0:
        return "Gemm with alpha != 1 or transA"
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if bias is not None and attr(node, "beta", 1.0) != 1.0:
        return "Gemm with a bias and beta != 1"
    return (w.T if attr(node, "transB", 0) else w), bias


def fuse_matmul_bf16(g: FusionGraph) -> tuple[RuleReport, dict[str, int]]:
    """Rewrite the candidates in place; returns the report and the weights' bytes before and after."""
    report = RuleReport()
    packed: dict[tuple[str, int], str] = {}  # (weight, transB) -> packed initializer (shared weights once)
    before = after = 0
    for node in list(g.nodes):
        m = _weight(g, node)
        if m is None:
            continue
        if isinstance(m, str):
            report.miss(node.name or node.output[0], m)
            continue
        w, bias = m
        k, n = w.shape
        key = (node.input[1], attr(node, "transB", 0) if node.op_type == "Gemm" else 0)
        if key not in packed:
            bits = pack_bf16(w)
            packed[key] = g.add_init(_bf16_tensor(bits, g.unique(f"{node.input[1]}_bf16")))
            before += w.nbytes
            after += bits.nbytes
        out = node.output[0]
        mm_out = g.unique(f"{out}_bf16") if bias is not None else out
        new = [helper.make_node(OP_TYPE, [node.input[0], packed[key]], [mm_out], name=g.unique(f"{node.name}_bf16"),
                                domain=DOMAIN, n=int(n))]
        if bias is not None:
            new.append(helper.make_node("Add", [mm_out, bias], [out], name=g.unique(f"{node.name}_bias")))
        i = g.index(node)
        g.nodes[i:i + 1] = new
        report.fired += 1
    if report.fired:
        g.ensure_opset(DOMAIN, 1)
    return report, {"weight_bytes_before": before, "weight_bytes_after": after}
