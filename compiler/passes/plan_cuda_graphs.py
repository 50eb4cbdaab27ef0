"""CUDA-graph planning: decode batch-size buckets, and a proof that the decode graph can be captured.

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so the decode step it captures
must have the same tensor shapes on every replay and must never wait for the host to read a
tensor's contents. This pass checks both on the lowered ONNX graph (after fusion and quantization
lowering, i.e. the graph that ships), for every decode bucket:

1. **No host synchronisation.** Tensor contents of the graph inputs are "values"; `Shape` and
   `Size` turn any tensor into a fact about shapes only. A node whose output *shape* would depend
   on a value (a `Reshape`/`Expand`/`Slice`/`Range`/`ConstantOfShape`/`Tile`/`Pad`/... whose shape
   operand derives from input contents), an op whose output size is data-dependent (`NonZero`,
   `Unique`, `Compress`, `NonMaxSuppression`), control flow (`If`, `Loop`, `Scan`: the host picks
   the branch) and any op this pass does not know are reported. With none, every shape in the graph
   is a function of the input shapes alone.
2. **Static shapes per bucket.** A decode step of `b` sequences has inputs of fixed shapes
   (`input_ids`/`positions`/`past_lens`/`slot_mapping`/`logits_index` [b], `cu_seqlens` [b+1],
   `block_table` [b, W] with W = ceil(max_model_len / block_size), the pools as allocated), so by
   (1) every intermediate shape is fixed too. With `verify` on, the graph runs on ONNX Runtime CPU
   for each bucket with two different sets of values (context lengths, positions, tokens) and the
   output shapes must be the expected ones and the same for both. A streamed build (compiler/streamed.py)
   holds no weights: its graph runs with each weight made as zeros when the run reaches it
   (`with_zero_weights`), which gives the shapes the weights would. A graph ONNX Runtime's CPU provider
   cannot run (bfloat16 arithmetic: the tensorrt/bfloat16 target) is checked by (1) alone, and the pass's
   `buckets_not_run` says why.

For the torch targets the same two checks run on the torch.export program (`fx_host_sync_findings`:
ops that read tensor contents on the host (`item`, `nonzero`, `unique`, boolean masking, control
flow) and any value whose shape has an unbacked (data-dependent) symbol; then every bucket runs
twice on CPU with different contents; a streamed build's on fake tensors). There the captured step
also writes the new K/V into the pools (`index_copy_`), so padded rows write into one extra pool block
the scheduler never uses.

The plan (buckets, the padding policy, each bucket's input shapes) goes into the manifest's
`cuda_graphs` for the runtime to capture at load on a GPU; a decode batch of n sequences runs in the
smallest bucket >= n, padded as the policy says; prefill and mixed steps, and decode batches
larger than the largest bucket, run without graphs. On a CPU target the plan is recorded with
`applies: false` and the reason (the checks still run: they say whether the graph could be
captured on a GPU build of the same recipe).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.streamed import deferred_of, streamed_count
from compiler.targets import target_for
from runtime.backends.pytorch import callable_program
from runtime.kernels.paged_attention_cpu import register, uses_kernel

log = logging.getLogger(__name__)

# op -> indices of the inputs that determine the output's shape (the rest only its values)
SHAPE_OPERANDS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Range": (0, 1, 2), "ConstantOfShape": (0,),
    "Tile": (1,), "Pad": (1, 3), "Resize": (2, 3), "Upsample": (1,), "TopK": (1,), "Split": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "OneHot": (1,), "CenterCropPad": (1,), "Col2Im": (1, 2),
    "DFT": (1,), "STFT": (2, 3), "MaxUnpool": (2,),
    **{r: (1,) for r in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                         "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")},
}
DATA_DEPENDENT_SIZE = {"NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit"}
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}
SHAPE_ONLY = {"Shape", "Size"}  # outputs carry shapes, never input contents
# Ops whose output shapes follow from their input shapes alone (standard elementwise/linear-algebra
# ops and the contrib ops the compiler emits); anything else is reported as unknown.
STATIC_OPS = {
    "Abs", "Add", "And", "ArgMax", "ArgMin", "Cast", "CastLike", "Ceil", "Clip", "Concat", "Constant", "Cos",
    "CumSum", "DequantizeLinear", "Div", "Einsum", "Equal", "Erf", "Exp", "Flatten", "Floor", "Gather",
    "GatherElements", "GatherND", "Gemm", "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN",
    "LayerNormalization", "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "Min", "Mod", "Mul",
    "Neg", "Not", "Or", "Pow", "QuantizeLinear", "Reciprocal", "Relu", "RMSNormalization",
    "RotaryEmbedding", "ScatterElements", "ScatterND", "Sigmoid", "Sign", "Sin", "Softmax", "Sqrt", "Sub",
    "Sum", "Tanh", "Transpose", "Trilu", "Where", "Xor", "SimplifiedLayerNormalization",
    # com.microsoft
    "MatMulNBits", "SkipSimplifiedLayerNormalization", "QuickGelu", "FusedMatMul", "GroupQueryAttention",
    "PagedAttention", "MatMulIntegerToFloat",
    # optimize (runtime/kernels/op_*.c): output [T, H*D] from the packed input's T; codes and
    # scales shaped as the input; products [.., N] from the input's leading dims; SiluMul [.., I] from [.., 2I];
    # SkipNormQuantize: codes, scales and sums shaped as its first input
    "RotaryPagedAttention", "QuantizeRows", "MatMulBf16", "SiluMul", "SkipNormQuantize",
}


@dataclass(frozen=True)
class CudaGraphOptions:
    decode_buckets: list[int] | None = None  # default: 1, 2, 4, ... below max_num_seqs, and max_num_seqs
    verify: bool = True  # run every bucket on ONNX Runtime CPU and check the output shapes

    def __post_init__(self) -> None:
        if self.decode_buckets is not None:
            b = list(self.decode_buckets)
            if not b or any(not isinstance(x, int) or x < 1 for x in b) or b != sorted(set(b)):
                raise ValueError(f"decode_buckets must be increasing positive integers, got {b}")


def default_buckets(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def host_sync_findings(model: Any) -> list[dict[str, str]]:
    """Nodes that would need the host to read tensor contents (or that this check cannot prove safe)."""
    init = {t.name for t in model.graph.initializer}
    valued = {i.name for i in model.graph.input if i.name not in init}  # tensors derived from input contents
    findings: list[dict[str, str]] = []
    for node in model.graph.node:
        op = node.op_type
        ins = [x for x in node.input]
        tainted = [i for i, x in enumerate(ins) if x and x in valued]
        if op in CONTROL_FLOW:
            findings.append({"node": node.name, "op": op, "reason": "control flow: the host picks the branch"})
        elif op in DATA_DEPENDENT_SIZE:
            findings.append({"node": node.name, "op": op, "reason": "output size depends on tensor contents"})
        elif op in SHAPE_OPERANDS:
            bad = [ins[i] for i in SHAPE_OPERANDS[op] if i in tainted]
            if bad:
                findings.append({"node": node.name, "op": op,
                                 "reason": f"shape operand {bad[0]!r} derives from input contents"})
        elif op not in STATIC_OPS and op not in SHAPE_ONLY:
            findings.append({"node": node.name, "op": op, "reason": "op not known to have static output shapes"})
        if op not in SHAPE_ONLY and tainted:
            valued.update(o for o in node.output if o)
    return findings


def bucket_inputs(model: Any, b: int, width: int, pool_blocks: int) -> dict[str, list[int]]:
    """Input shapes of a decode step of b sequences with a block table of `width` columns."""
    fixed = {"input_ids": [b], "positions": [b], "cu_seqlens": [b + 1], "past_lens": [b],
             "block_table": [b, width], "slot_mapping": [b], "logits_index": [b]}
    shapes: dict[str, list[int]] = {}
    for i in model.graph.input:
        if i.name in fixed:
            shapes[i.name] = fixed[i.name]
        else:  # KV pools: [num_blocks, block_size, kv_heads, head_dim]
            dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
            shapes[i.name] = [pool_blocks if d is None else d for d in dims]
    return shapes


def with_zero_weights(model: Any) -> Any:
    """A copy of a streamed graph (compiler/streamed.py) for the bucket runs: each streamed initializer becomes a
    ConstantOfShape of its shape (zeros; a Cast from float32 zeros for FP8 / INT4), made when the run reaches
    it and freed after its last use, so the run never holds the model's weights. Shapes and the graph's ops are
    what the runs check; the values are not."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    # element types ONNX Runtime's CPU ConstantOfShape makes; others (E4M3, INT4) are made in float32 and cast
    direct = {getattr(TensorProto, t) for t in ("FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "BOOL", "INT8", "INT16",
                                                "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept, made = [], []
    for t in out.graph.initializer:
        if deferred_of(t) is None:
            kept.append(t)
            continue
        shape = numpy_helper.from_array(np.array(list(t.dims), np.int64), f"{t.name}.zeros_shape")
        kept.append(shape)
        if t.data_type in direct:
            made.append(helper.make_node("ConstantOfShape", [shape.name], [t.name],
                                         value=helper.make_tensor("value", t.data_type, [1], [0])))
        else:
            made += [helper.make_node("ConstantOfShape", [shape.name], [f"{t.name}.zeros"],
                                      value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0])),
                     helper.make_node("Cast", [f"{t.name}.zeros"], [t.name], to=t.data_type)]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    nodes = made + list(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


class NoCpuKernel(Exception):
    """The graph has a node ONNX Runtime's CPU provider cannot run: its buckets are checked by the taint analysis
    alone."""


def _run_buckets(model: Any, buckets: list[int], width: int, block_size: int, vocab: int,
                 kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Run each bucket twice with different contents; return output shapes (raise on a mismatch)."""
    import onnxruntime as ort
    from onnx import TensorProto
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedError_

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if uses_kernel(model):
        register(so)
    if streamed_count(model):  # weights not in memory: zeros made during the run, never folded into a session
        model = with_zero_weights(model)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except NotImplementedError_ as e:  # e.g. bfloat16 arithmetic, which ONNX Runtime CPU has no kernels for
        raise NoCpuKernel(str(e).split(":", 2)[-1].strip()) from e
    np_types = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.INT8: np.int8,
                TensorProto.UINT8: np.uint8}
    pool_blocks = width + 1
    rng = np.random.default_rng(0)
    got: dict[str, Any] = {}
    for b in buckets:
        shapes = bucket_inputs(model, b, width, pool_blocks)
        seen = None
        for trial in range(2):
            ctx_len = rng.integers(0, width * block_size, size=b) if trial else np.zeros(b, np.int64)
            feeds: dict[str, np.ndarray] = {
                "input_ids": rng.integers(0, vocab, size=b).astype(np.int64),
                "positions": ctx_len.astype(np.int64),
                "cu_seqlens": np.arange(b + 1, dtype=np.int32),
                "past_lens": ctx_len.astype(np.int32),
                "block_table": (rng.integers(0, pool_blocks, size=(b, width)) if trial
                                else np.zeros((b, width))).astype(np.int32),
                "slot_mapping": np.zeros(b, np.int64),
                "logits_index": np.arange(b, dtype=np.int64),
            }
            for i in model.graph.input:
                if i.name not in feeds:
                    feeds[i.name] = np.zeros(shapes[i.name], np_types.get(i.type.tensor_type.elem_type, np.float32))
            names = {i.name for i in sess.get_inputs()}
            outs = sess.run(None, {k: v for k, v in feeds.items() if k in names})
            shape_list = [list(o.shape) for o in outs]
            if seen is not None and shape_list != seen:
                raise BuildError(f"plan_cuda_graphs: bucket {b}: output shapes change with input contents "
                                 f"({seen} vs {shape_list})")
            seen = shape_list
        expect = [[b, vocab]] + [[b, kv_heads, head_dim]] * (len(seen) - 1)
        if seen != expect:
            raise BuildError(f"plan_cuda_graphs: bucket {b}: output shapes {seen[:3]}..., expected {expect[:3]}...")
        got[str(b)] = seen[0]
    return got


def _has_cuda_only_ops(model: Any) -> bool:
    """PagedAttention has no CPU kernel: such a graph is checked by the taint analysis only."""
    return any(n.op_type == "PagedAttention" and n.domain == "com.microsoft" for n in model.graph.node)


# aten ops that read tensor contents on the host, or whose output size depends on them
_FX_HOST_SYNC = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "unique", "_unique", "_unique2",
                 "unique_consecutive", "unique_dim", "masked_select", "repeat_interleave", "tolist", "is_nonzero",
                 "_assert_async", "equal", "allclose"}


def fx_host_sync_findings(exported: Any) -> list[dict[str, str]]:
    """Nodes of a torch.export program that need the host to read tensor contents, or that produce a
    value with a data-dependent (unbacked) size; control flow (cond, while_loop) is reported too."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    findings: list[dict[str, str]] = []
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        name = getattr(target, "__name__", str(target))
        base = name.split(".")[0]
        if base in ("cond", "while_loop", "map_impl", "scan"):
            findings.append({"node": node.name, "op": name, "reason": "control flow: the host picks the branch"})
        elif base in _FX_HOST_SYNC:
            findings.append({"node": node.name, "op": name, "reason": "reads tensor contents on the host or has "
                             "a data-dependent output size"})
        else:
            val = node.meta.get("val")
            vals = val if isinstance(val, (list, tuple)) else [val]
            if any(hasattr(v, "shape") and free_unbacked_symbols(v) for v in vals):
                findings.append({"node": node.name, "op": name, "reason": "output shape depends on tensor contents"})
    return findings


def _run_buckets_torch(exported: Any, buckets: list[int], width: int, block_size: int, cfg: Any,
                       shapes_only: bool = False) -> dict[str, Any]:
    """The torch twin of _run_buckets: each bucket twice on CPU with different contents. `shapes_only` (a streamed
    build, whose weights are not in memory): the program runs on fake tensors (FakeTensorMode: shapes, dtypes
    and the custom ops' fake kernels, no values; an op that needs a value to know a shape fails there), so
    the weights are never read."""
    import torch

    program = callable_program(exported)
    dtype = next((p.dtype for p in exported.state_dict.values() if p.is_floating_point()), torch.float32)
    pool_blocks = width + 1
    if shapes_only:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode: Any = FakeTensorMode(allow_non_fake_inputs=True)  # the weights become fake as they are used
    else:
        mode = contextlib.nullcontext()
    with mode:
        pools = [torch.zeros(pool_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
                 for _ in range(2 * cfg.num_layers)]
    gen = torch.Generator().manual_seed(0)
    got: dict[str, Any] = {}
    for b in buckets:
        seen = None
        for trial in range(2):
            ctx_len = (torch.randint(0, width * block_size, (b,), generator=gen) if trial
                       else torch.zeros(b, dtype=torch.int64))
            table = (torch.randint(0, pool_blocks, (b, width), generator=gen) if trial
                     else torch.full((b, width), -1)).to(torch.int32)
            with torch.no_grad(), mode:
                outs = program(torch.randint(0, cfg.vocab_size, (b,), generator=gen), ctx_len.clone(),
                               torch.arange(b + 1, dtype=torch.int32), ctx_len.to(torch.int32), table,
                               torch.arange(b), *pools)
            shape_list = [list(o.shape) for o in outs]
            if seen is not None and shape_list != seen:
                raise BuildError(f"plan_cuda_graphs: bucket {b}: output shapes change with input contents "
                                 f"({seen} vs {shape_list})")
            seen = shape_list
        expect = [[b, cfg.vocab_size]] + [[b, cfg.num_kv_heads, cfg.head_dim]] * (len(seen) - 1)
        if seen != expect:
            raise BuildError(f"plan_cuda_graphs: bucket {b}: output shapes {seen[:3]}..., expected {expect[:3]}...")
        got[str(b)] = seen[0]
    return got


class PlanCudaGraphsPass(Pass):
    """Decode batch buckets + the static-shape / no-host-sync check of the decode graph."""

    name: ClassVar[str] = "plan_cuda_graphs"
    Config = CudaGraphOptions
    requires = ("capture",)
    summary = "decode buckets for CUDA graphs; checks static shapes per bucket and no host synchronisation"

    def check_recipe(self, recipe: Any) -> tuple[str, str] | None:
        target = target_for(recipe.target.backend, recipe.target.device)
        names = [p.name for p in recipe.passes]
        if target is not None and target.onnx and "lower_onnx" not in names[:names.index(self.name)]:
            return ("name", "plan_cuda_graphs checks the lowered ONNX graph: put it after lower_onnx (and fuse)")
        buckets = self.config.decode_buckets
        if buckets and buckets[-1] > recipe.runtime.max_num_seqs:
            return ("options.decode_buckets", f"bucket {buckets[-1]} exceeds runtime.max_num_seqs "
                    f"({recipe.runtime.max_num_seqs}): no decode step has that many sequences")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        rt = ctx.recipe.runtime
        cfg = ctx.checkpoint.config
        buckets = list(self.config.decode_buckets or default_buckets(rt.max_num_seqs))
        max_len = ctx.max_model_len
        width = -(-max_len // rt.kv_block_size)
        torch_target = "onnx" not in ctx.artifacts
        verified: dict[str, Any] | None = None
        not_run: str | None = None  # why the buckets were not run, where verify is on
        if torch_target:
            exported = ctx.require("exported", self.name)
            findings = fx_host_sync_findings(exported)
            capturable = not findings
            if self.config.verify and capturable:
                verified = _run_buckets_torch(exported, buckets, width, rt.kv_block_size, cfg,
                                              shapes_only=bool(ctx.artifacts.get("deferred_params")))
            nodes = len(exported.graph.nodes)
            shapes = {str(b): {"input_ids": [b], "cu_seqlens": [b + 1], "block_table": [b, width]} for b in buckets}
        else:
            model = ctx.require("onnx", self.name)
            findings = host_sync_findings(model)
            capturable = not findings
            if self.config.verify and capturable and not _has_cuda_only_ops(model):
                try:
                    verified = _run_buckets(model, buckets, width, rt.kv_block_size, cfg.vocab_size,
                                            cfg.num_kv_heads, cfg.head_dim)
                except NoCpuKernel as e:
                    not_run = f"ONNX Runtime CPU cannot run the graph ({e}); checked by the taint analysis only"
                    log.info("plan_cuda_graphs: buckets not run: %s", not_run)
            nodes = len(model.graph.node)
            shapes = {str(b): {k: v for k, v in bucket_inputs(model, b, width, rt.num_kv_blocks).items()
                               if k in ("input_ids", "cu_seqlens", "block_table")} for b in buckets}
        device = ctx.recipe.target.device
        applies = device == "cuda" and capturable
        if device != "cuda":
            reason = f"{device} target: CUDA graphs are captured only for device: cuda"
        elif not capturable:
            reason = f"the decode graph cannot be captured: {len(findings)} node(s) need the host"
        else:
            reason = "decode steps of up to the largest bucket replay a captured graph"
        plan = {
            "applies": applies,
            "reason": reason,
            "capturable": capturable,
            "decode_buckets": buckets,
            "block_table_width": width,
            "padding": {
                "batch": "a decode batch of n sequences runs in the smallest bucket >= n; larger batches, "
                         "prefill and mixed steps run without a graph",
                "padded_rows": {"input_ids": 0, "positions": 0, "past_lens": 0, "cu_seqlens": "one token per row",
                                "block_table": "a row of -1 (past_lens 0: nothing is read)",
                                "logits": "dropped",
                                "new_kv": "written to an extra pool block that is never scheduled" if torch_target
                                else "not scattered (slot -1)"},
                "block_table": f"every row padded with -1 to {width} columns",
            },
            "bucket_inputs": shapes,
            "host_sync_findings": findings[:20],
        }
        ctx.artifacts["cuda_graphs"] = plan
        return {
            "applies": applies,
            "capturable": capturable,
            "decode_buckets": buckets,
            "host_sync_findings": len(findings),
            "verified_buckets": sorted(int(k) for k in verified) if verified else [],
            **({"buckets_not_run": not_run} if not_run else {}),
            "nodes": nodes,
        }
