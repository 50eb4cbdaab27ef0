"""Lowering of quantization: write the quantize_* passes' tensors into the ONNX graph.

Runs after lower_onnx. Every quantized weight initializer becomes DequantizeLinear from its stored
form (the portable QDQ IR: blocked uint4 with zero points for INT4, float8e4m3fn for FP8); FP8
activations get QuantizeLinear/DequantizeLinear before their Gemm; a quantized KV cache changes
the pool inputs and new K/V outputs to int8 / E4M3 (where the paged_cpu kernel reads the pools, it
gets the per-head scales as its k_scale / v_scale inputs and reads and writes the int8 pool itself). For ONNX Runtime, `int4_format: matmulnbits`
(the default) then rewrites each DQ(uint4) + Gemm into com.microsoft.MatMulNBits; each DQ(int8) +
Gemm of quantize_int8 becomes an integer GEMM (MatMulIntegerToFloat by default) with its input
quantized at run time. The rewrites and their counts are in compiler/quant/onnx_rules.py; the pass
ends with onnx.checker (full).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.streamed import checkable, stored_bytes
from runtime.kernels.paged_attention_cpu import DOMAIN, OP_TYPE, ROPE_OP_TYPE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LowerQuantOptions:
    int4_format: Literal["matmulnbits", "qdq"] = "matmulnbits"  # qdq: keep DequantizeLinear + Gemm
    # MatMulNBits: 0 = float compute; 4 = int8 compute of the activations (VNNI; per block of the weight's
    # group). None: 4 on ONNX Runtime CPU (measured faster at the demo's and the accuracy bounds,
    # docs/architecture.md "Quantization"), 0 elsewhere (the CUDA kernels compute in float).
    accuracy_level: int | None = None
    # quantize_int8's integer GEMM; auto: the measured best for its activation mode (INT8_AUTO)
    int8_op: Literal["auto", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulInteger"] = "auto"

    def __post_init__(self) -> None:
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level}")
        if self.int8_op not in ("auto", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulInteger"):
            raise ValueError(f"int8_op must be auto, MatMulIntegerToFloat, DynamicQuantizeMatMul or MatMulInteger, "
                             f"got {self.int8_op!r}")


# quantize_int8 activation mode -> the integer GEMM `int8_op: auto` writes (measured on ONNX Runtime CPU,
# docs/architecture.md "Quantization")
INT8_AUTO = {"per_token": "MatMulIntegerToFloat", "per_tensor": "MatMulIntegerToFloat"}


def _kernel_reading(g: Any, pool: str) -> Any:
    """The optimize-domain attention node (the paged_cpu kernel) that reads `pool`, if that is its one reader."""
    users = g.consumers(pool)
    if len(users) == 1 and users[0].domain == DOMAIN and users[0].op_type in (OP_TYPE, ROPE_OP_TYPE):
        return users[0]
    return None


def _initializer_bytes(model: Any, names: set[str]) -> int:
    return sum(stored_bytes(t) for t in model.graph.initializer if t.name in names)


class LowerQuantPass(Pass):
    """Write quantized weights, activations and KV cache into the ONNX graph (QDQ, MatMulNBits)."""

    name: ClassVar[str] = "lower_quant"
    Config = LowerQuantOptions
    requires = ("lower_onnx",)
    summary = ("quantized tensors -> DequantizeLinear (QDQ IR) / MatMulNBits / INT8 integer GEMMs, FP8 activation "
               "Q/DQ, KV-cache Q/DQ")

    def skip_reason(self, ctx: BuildContext) -> str | None:
        st = ctx.artifacts.get("quant")
        if st is None or (not st.weights and st.kv_cache is None):
            return "no quantize pass ran before it: nothing to lower"
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from compiler.quant import onnx_rules as R
        from compiler.quant.int4 import Int4Weight

        model = ctx.require("onnx", self.name)
        st = ctx.artifacts["quant"]
        nodes_before = len(model.graph.node)
        g = R.Graph(model)
        stats: dict[str, Any] = {}
        if any(isinstance(q.data, Int4Weight) for q in st.weights.values()):
            stats["int4_format"] = self.config.int4_format

        # the graph's float type: scales and activation constants are stored in it
        dtype = ctx.recipe.target.dtype
        float_type = R.FLOAT_TYPES.get(dtype)
        if float_type is None:
            raise BuildError(f"lower_quant: {dtype} graphs are not lowered; use one of {', '.join(R.FLOAT_TYPES)}")
        # 1. the float initializers must hold the torch model's (quantized, AWQ-scaled) values
        stats["initializers_synced"] = _sync_initializers(ctx, g, st, dtype)
        # 2. weights -> DequantizeLinear
        fp32_bytes = sum(int(np.prod(q.data.shape)) * 4 for q in st.weights.values())
        # symmetric INT4 in the QDQ form: signed int4, no zero point (what TensorRT dequantizes)
        dq_nodes = _weights_to_dq(g, st, float_type, signed_int4=self.config.int4_format == "qdq")
        # 3. FP8 activations
        act_pairs = _activations_to_qdq(g, st, float_type, dq_nodes)
        if act_pairs:
            stats["activation_qdq_pairs"] = act_pairs
        # 4. INT4 DQ + Gemm -> MatMulNBits
        if self.config.int4_format == "matmulnbits":
            stats.update(self._int4_to_matmulnbits(ctx, g, st, float_type, dq_nodes))
        # 4b. INT8 DQ + Gemm -> an integer GEMM with the input quantized at run time
        stats.update(self._int8_to_integer_gemm(g, st, dq_nodes))
        # 5. KV cache
        if st.kv_cache is not None:
            stats["kv_cache"] = _kv_cache_to_qdq(g, st.kv_cache, ctx.checkpoint.config)
            ctx.artifacts["kv_cache_dtype"] = st.kv_cache.dtype

        g.commit()
        _check_graph(model)
        stats.update(_size_stats(model, st, fp32_bytes, nodes_before))
        return stats

    def _int4_to_matmulnbits(self, ctx: BuildContext, g: Any, st: Any, float_type: type, dq_nodes: dict[str, Any]
                             ) -> dict[str, Any]:
        """Each INT4 DequantizeLinear + Gemm -> com.microsoft.MatMulNBits; its stats (none without INT4 weights)."""
        from compiler.quant import onnx_rules as R
        from compiler.quant.int4 import Int4Weight

        int4 = {dq_nodes[n].input[0]: q.data for n, q in st.weights.items() if isinstance(q.data, Int4Weight)}
        if not int4:
            return {}
        rule = R.DqGemmToMatMulNBits(float_type)
        level = self.config.accuracy_level
        if level is None:
            level = 4 if (ctx.recipe.target.backend, ctx.recipe.target.device) == ("onnxruntime", "cpu") else 0
        stats: dict[str, Any] = {"accuracy_level": level}
        fired, not_fused = 0, {}
        for name in sorted(st.weights):
            dq = dq_nodes[name]
            if dq.input[0] not in int4:
                continue
            reason = rule.check(g, dq)
            if reason:
                not_fused[name] = reason
                continue
            fired += rule.rewrite(g, dq, int4, level)
        stats["matmulnbits_fused"] = fired
        if not_fused:
            stats["matmulnbits_not_fused"] = dict(sorted(not_fused.items()))
        if fired:
            _add_ms_opset(g.model)
        return stats

    def _int8_to_integer_gemm(self, g: Any, st: Any, dq_nodes: dict[str, Any]) -> dict[str, Any]:
        """Each INT8 DequantizeLinear + Gemm -> the integer GEMM of `int8_op`; its stats (none without INT8
        weights). A weight that cannot be lowered fails the build: a float GEMM would silently drop the int8
        compute the recipe asked for."""
        from compiler.quant import onnx_rules as R
        from compiler.quant.int8 import Int8Weight

        int8 = {n: q.data for n, q in st.weights.items() if isinstance(q.data, Int8Weight)}
        if not int8:
            return {}
        modes = {w.activations for w in int8.values()}
        if len(modes) != 1:
            raise BuildError(f"lower_quant: int8 weights with mixed activation modes {sorted(modes)}")
        mode = modes.pop()
        op = INT8_AUTO[mode] if self.config.int8_op == "auto" else self.config.int8_op
        if op not in R.INT8_OPS[mode]:
            raise BuildError(f"lower_quant: int8_op {op} does not take {mode} activations; "
                             f"use one of {', '.join(R.INT8_OPS[mode])} (or auto)")
        rule8 = R.DqGemmToInt8(op, mode)
        fired8, not_lowered = 0, {}
        for name in sorted(int8):
            reason = rule8.check(g, dq_nodes[name])
            if reason:
                not_lowered[name] = reason
                continue
            fired8 += rule8.rewrite(g, dq_nodes[name], int8[name])
        if not_lowered:
            raise BuildError("lower_quant: int8 weights that cannot be lowered to an integer GEMM:\n  " +
                             "\n  ".join(f"{k}: {v}" for k, v in sorted(not_lowered.items())))
        _add_ms_opset(g.model)
        return {"int8_op": op, "int8_activations": mode, "int8_matmuls": fired8,
                "int8_input_quantizations": rule8.quantized_inputs or fired8}


def _sync_initializers(ctx: BuildContext, g: Any, st: Any, dtype: str) -> int:
    """The float initializers set to the torch model's (quantized, AWQ-scaled) values; how many changed. A
    parameter quantization changed that the graph has no initializer of (by name and shape) fails the build."""
    import onnx
    import torch

    from compiler.quant import onnx_rules as R

    synced = 0
    torch_model = ctx.require("model", "lower_quant")
    deferred = ctx.artifacts.get("deferred_params", {})  # streamed: read from the checkpoint when written
    for pname, p in torch_model.named_parameters():
        if pname in deferred:
            continue
        init = g.inits.get(pname)
        value = R.torch_to_numpy(p.detach(), getattr(torch, dtype))
        if init is None or tuple(init.dims) != value.shape:
            ref = ctx.artifacts.get("reference_model")
            if ref is not None and not torch.equal(ref.get_parameter(pname), p) and pname not in st.weights:
                raise BuildError(f"lower_quant: parameter {pname} was changed by quantization but the lowered "
                                 "graph has no initializer of that name and shape")
            continue
        if onnx.numpy_helper.to_array(init).tobytes() != value.tobytes():
            g.inits[pname] = onnx.numpy_helper.from_array(value, pname)
            synced += 1
    return synced


def _weights_to_dq(g: Any, st: Any, float_type: type, signed_int4: bool) -> dict[str, Any]:
    """Each quantized weight initializer -> its stored form and a DequantizeLinear; weight name -> the node.
    Weights that cannot be lowered fail the build, all named."""
    from compiler.quant import onnx_rules as R

    to_qdq = R.WeightToQdq(float_type, signed_int4=signed_int4)
    misses: dict[str, str] = {}
    dq_nodes: dict[str, Any] = {}
    for name, q in sorted(st.weights.items()):
        reason = to_qdq.check(g, q)
        if reason:
            misses[name] = reason
            continue
        dq_nodes[name] = to_qdq.rewrite(g, q)
    if misses:
        raise BuildError("lower_quant: quantized weights that cannot be lowered:\n  " +
                         "\n  ".join(f"{k}: {v}" for k, v in misses.items()))
    return dq_nodes


def _activations_to_qdq(g: Any, st: Any, float_type: type, dq_nodes: dict[str, Any]) -> int:
    """QuantizeLinear / DequantizeLinear before the Gemm of each Linear with quantized (FP8) activations;
    returns the pairs written."""
    from compiler.quant import onnx_rules as R

    act = R.ActivationQdq(float_type)
    dq_out = {name: node.output[0] for name, node in dq_nodes.items()}
    shared: dict[tuple[str, float], str] = {}
    act_pairs = 0
    for name, q in sorted(st.weights.items()):
        if q.act_mode == "none" or q.kind != "linear":
            continue
        reason = act.check(g, q, dq_out[name])
        if reason:
            raise BuildError(f"lower_quant: {name}: {reason}")
        act_pairs += act.rewrite(g, q, dq_out[name], shared)
    return act_pairs


def _kv_cache_to_qdq(g: Any, kv: Any, cfg: Any) -> dict[str, Any]:
    """The quantized KV cache in the graph: each layer's pool inputs and new K/V outputs in the stored type,
    dequantized after the row gather and quantized before the write (or, where the paged_cpu kernel reads the
    pools, its per-head scales as k_scale / v_scale inputs); its stats."""
    import onnx

    from compiler.quant import onnx_rules as R

    rule = R.KvCacheQdq(kv)
    in_type, out_type = rule.onnx_dtypes()
    inputs: set[str] = set()
    outputs: set[str] = set()
    in_kernel = 0
    for i in range(cfg.num_layers):
        kernel = _kernel_reading(g, f"key_cache.{i}")
        if kernel is not None:  # paged_cpu: the C kernel reads the int8 pool and quantizes its writes
            if kv.dtype != "int8" or _kernel_reading(g, f"value_cache.{i}") is not kernel:
                raise BuildError(f"lower_quant: KV cache: layer {i}'s pools are read by "
                                 f"optimize.{kernel.op_type}, which takes int8 pools only (this is {kv.dtype})")
            for kind, scales in (("key", kv.k_scales[i]), ("value", kv.v_scales[i])):
                sc = onnx.numpy_helper.from_array(np.asarray(scales, np.float32), g.unique(f"{kind}_cache.{i}_scale"))
                kernel.input.append(g.add_init(sc))
                rule.rewrite_output(g, f"new_{kind}.{i}", scales)
                inputs.add(f"{kind}_cache.{i}")
                outputs.add(f"new_{kind}.{i}")
            in_kernel += 1
            continue
        for kind, scales in (("key", kv.k_scales[i]), ("value", kv.v_scales[i])):
            name = f"{kind}_cache.{i}"
            reason = rule.check_input(g, name, cfg.head_dim)
            if reason:
                raise BuildError(f"lower_quant: KV cache: {reason}")
            rule.rewrite_input(g, name, scales)
            rule.rewrite_output(g, f"new_{kind}.{i}", scales)
            inputs.add(name)
            outputs.add(f"new_{kind}.{i}")
    R.set_elem_type(g.model.graph.input, inputs, in_type)
    R.set_elem_type(g.model.graph.output, outputs, out_type)
    return {"dtype": kv.dtype, "pool_storage": "int8" if kv.dtype == "int8" else "uint8 (E4M3 bits)",
            "layers": cfg.num_layers, "layers_read_by_the_kernel": in_kernel}


def _add_ms_opset(model: Any) -> None:
    """The com.microsoft opset import, once (MatMulNBits and the integer GEMMs are in that domain)."""
    import onnx

    from compiler.quant import onnx_rules as R

    if not any(o.domain == R.MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(R.MS_DOMAIN, 1))


def _check_graph(model: Any) -> None:
    """onnx.checker (full) on the rewritten graph."""
    import onnx

    try:
        onnx.checker.check_model(checkable(model), full_check=True)
    except Exception as e:
        raise BuildError(f"lower_quant: the rewritten graph fails onnx.checker: {str(e).splitlines()[0]}") from e


def _size_stats(model: Any, st: Any, fp32_bytes: int, nodes_before: int) -> dict[str, Any]:
    """The stored size of the quantized weights against float32, and the graph's op counts."""
    new_names = {t.name for t in model.graph.initializer if any(t.name.startswith(f"{n}_") for n in st.weights)}
    q_bytes = _initializer_bytes(model, new_names)
    ops = Counter(n.op_type for n in model.graph.node)
    stats: dict[str, Any] = {}
    if st.weights:
        stats.update({
            "quantized_weights": len(st.weights),
            "quantized_weight_bytes": q_bytes,
            "quantized_weight_fp32_bytes": fp32_bytes,
            "quantized_weight_ratio": round(q_bytes / fp32_bytes, 6),
        })
    stats.update({
        "op_counts": {k: ops[k] for k in sorted(ops) if k in (
            "MatMulNBits", "DequantizeLinear", "QuantizeLinear", "Gemm", "MatMul", "Gather",
            "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger")},
        "nodes_before": nodes_before,
        "nodes": sum(ops.values()),
    })
    return stats
