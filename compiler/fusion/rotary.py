"""Rotary embedding (rotate-half form, packed tokens) -> com.microsoft.RotaryEmbedding.

onnxscript's `rotary_embedding.fuse_rotary_embedding` + `cos_sin_cache.fuse_cos_sin_cache` do not
match our graph: they expect 4-D [B, N, S, H] activations sliced on axis 3 and transformers' cos/sin
computation (MatMul(inv_freq[1, E, 1], position_ids) -> Transpose). Our model (compiler/models/llama.py)
packs tokens without padding and computes, once per step,

    freqs = Cast(positions[T], float) [T, 1] * inv_freq [1, d/2];  emb = Concat(freqs, freqs, -1)
    cos, sin = Cos(emb), Sin(emb) [-> Cast(activation dtype)] -> Unsqueeze(axis 1) -> [T, 1, d]

and for each of q [T, heads, d] and k [T, kv_heads, d] (after the q/k norm on Qwen3):

    out = x * cos + Concat(-x[..., d/2:], x[..., :d/2], -1) * sin

This rule matches exactly that (each constant checked) and writes

    Reshape(x, [1, -1, heads * d]) -> RotaryEmbedding(., position_ids = Unsqueeze(positions, 0) [1, T],
        cos_cache, sin_cache; num_heads, interleaved=0) -> Reshape(., [-1, heads, d])

ONNX Runtime's kernel takes 3-D input as [batch, seq, heads * head_size] (4-D would be [B, N, S, H],
which packed tokens are not). The caches are initializers [rows, d/2] computed as the model computes
cos/sin (float32 positions * the graph's own inv_freq constant, then cos/sin, in torch float32);
rows = the artifact's max_model_len (ONNX Runtime refuses a position outside the cache with an
error, and the engine never schedules a position >= max_model_len). In a float16 or bfloat16 graph (onnxruntime/cuda) the
model casts cos/sin to the activation dtype (the kernel takes caches of its input's type): the
caches are then the float32 values cast the same way, so the fused graph multiplies by exactly the
numbers the unfused one did. The nodes that computed cos/sin in the graph become dead and are removed.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport, attr, const_array, shape_of, tensor

_BIG = 2**31 - 1
# the activation dtypes of the ONNX targets (onnxruntime/cpu float32, onnxruntime/cuda float16 or bfloat16, as
# ml_dtypes.bfloat16, which onnx's numpy_helper stores); RotaryEmbedding takes caches of its input's type
_CACHE_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}


def rope_cache(inv_freq: np.ndarray, rows: int, dtype: int = TensorProto.FLOAT) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [rows, d/2] in `dtype` (an ONNX element type of _CACHE_DTYPES), computed as the model
    does: float32 positions * inv_freq, cos/sin in float32, then cast (round to nearest, as the graph's
    Cast does)."""
    import torch

    inv = torch.from_numpy(np.array(inv_freq, np.float32).reshape(-1))
    freqs = torch.arange(rows, dtype=torch.int64).to(torch.float32).unsqueeze(1) * inv.unsqueeze(0)
    np_dtype = _CACHE_DTYPES[dtype]
    return freqs.cos().numpy().astype(np_dtype), freqs.sin().numpy().astype(np_dtype)


class _Matcher:
    def __init__(self, g: FusionGraph) -> None:
        self.g = g
        self.producers = g.producer_map()
        self.graph_inputs = {i.name: i for i in g.model.graph.input}

    def prod(self, name: str, op: str) -> onnx.NodeProto | None:
        p = self.producers.get(name)
        return p if p is not None and p.op_type == op and p.domain in ("", "ai.onnx") else None

    def const(self, name: str) -> list | None:
        a = const_array(self.g, name) if name else None
        return None if a is None else a.reshape(-1).tolist()

    def trig(self, name: str, op: str) -> onnx.NodeProto | None:
        """The Cos/Sin node behind Unsqueeze(trig(emb), axes=[1]) or Unsqueeze(Cast(trig(emb)), axes=[1])."""
        u = self.prod(name, "Unsqueeze")
        if u is None or self.const(u.input[1]) != [1]:
            return None
        cast = self.prod(u.input[0], "Cast")
        return self.prod(cast.input[0] if cast is not None else u.input[0], op)

    def trig_dtype(self, name: str) -> int:
        """The element type of Unsqueeze(...) `name` feeds the product: a Cast's `to`, else float32."""
        u = self.producers[name]
        cast = self.prod(u.input[0], "Cast")
        return int(attr(cast, "to")) if cast is not None else TensorProto.FLOAT

    def match(self, add: onnx.NodeProto) -> tuple[str, str, int, int, int] | str | None:
        """(x, inv_freq initializer, heads, head_dim, cache dtype); a reason when it half-matches; None
        otherwise."""
        if len(add.input) != 2:
            return None
        muls = [self.prod(x, "Mul") for x in add.input]
        if any(m is None for m in muls):
            return None
        for m_cos, m_sin in ((muls[0], muls[1]), (muls[1], muls[0])):
            cos_side = [(self.trig(y, "Cos"), x, y) for x, y in (m_cos.input, m_cos.input[::-1])]  # type: ignore[union-attr]
            sin_side = [(self.trig(y, "Sin"), r, y) for r, y in (m_sin.input, m_sin.input[::-1])]  # type: ignore[union-attr]
            c = next(((t, x, y) for t, x, y in cos_side if t is not None), None)
            s = next(((t, r, y) for t, r, y in sin_side if t is not None), None)
            if c is None or s is None:
                continue
            (cos, x, cos_u), (sin, r, sin_u) = c, s
            return self._check(x, r, cos, sin, self.trig_dtype(cos_u), self.trig_dtype(sin_u))
        return None

    def _check(self, x: str, r: str, cos: onnx.NodeProto, sin: onnx.NodeProto, cos_dtype: int,
               sin_dtype: int) -> tuple[str, str, int, int, int] | str:
        if cos.input[0] != sin.input[0]:
            return "cos and sin of different angles"
        x_info = self.g.value_info.get(x)
        x_dtype = x_info.type.tensor_type.elem_type if x_info is not None else None
        if cos_dtype not in _CACHE_DTYPES:
            return f"cos/sin are {TensorProto.DataType.Name(cos_dtype)}: no RotaryEmbedding cache of that type"
        if cos_dtype != sin_dtype or (x_dtype is not None and x_dtype != cos_dtype):
            return (f"cos/sin are {TensorProto.DataType.Name(cos_dtype)}/{TensorProto.DataType.Name(sin_dtype)} "
                    f"and the input {TensorProto.DataType.Name(x_dtype) if x_dtype else 'of unknown type'}: "
                    "the kernel takes caches of its input's type")
        shape = shape_of(self.g, x)
        if shape is None or len(shape) != 3 or not isinstance(shape[1], int) or not isinstance(shape[2], int):
            return f"input {x} is not [T, heads, head_dim] with static heads and head_dim (shape {shape})"
        heads, d = shape[1], shape[2]
        half = d // 2
        # rotate_half(x) = Concat(Neg(x[..., half:]), x[..., :half], axis=-1)
        cat = self.prod(r, "Concat")
        if cat is None or len(cat.input) != 2 or attr(cat, "axis") not in (-1, 2):
            return "rotate_half is not a Concat of two halves on the last axis"
        neg = self.prod(cat.input[0], "Neg")
        hi = self.prod(neg.input[0], "Slice") if neg is not None else None
        lo = self.prod(cat.input[1], "Slice")
        if hi is None or lo is None:
            return "rotate_half is not Concat(Neg(Slice), Slice)"
        for sl, start, end_ok in ((hi, half, lambda e: e >= d), (lo, 0, lambda e: e == half)):
            ins = list(sl.input) + [""] * (5 - len(sl.input))
            starts, ends, axes = self.const(ins[1]), self.const(ins[2]), self.const(ins[3]) if ins[3] else [0]
            steps = self.const(ins[4]) if ins[4] else [1]
            if sl.input[0] != x or starts != [start] or ends is None or len(ends) != 1 or not end_ok(ends[0]) \
                    or axes not in ([2], [-1]) or steps != [1]:
                return "the halves of rotate_half are not x[..., d/2:] and x[..., :d/2]"
        # emb = Concat(freqs, freqs); freqs = Unsqueeze(Cast(positions), [1]) * inv_freq
        emb = self.prod(cos.input[0], "Concat")
        if emb is None or len(emb.input) != 2 or emb.input[0] != emb.input[1] or attr(emb, "axis") not in (-1, 1):
            return "the angles are not Concat(freqs, freqs)"
        mul = self.prod(emb.input[0], "Mul")
        if mul is None:
            return "freqs is not positions * inv_freq"
        for pos_side, inv in (tuple(mul.input), tuple(mul.input)[::-1]):
            inv_value = const_array(self.g, inv)
            if inv_value is None:
                continue
            u = self.prod(pos_side, "Unsqueeze")
            cast = self.prod(u.input[0], "Cast") if u is not None and self.const(u.input[1]) == [1] else None
            if cast is None or attr(cast, "to") != TensorProto.FLOAT:
                return "freqs is not float(positions)[:, None] * inv_freq"
            pos = self.graph_inputs.get(cast.input[0])
            if pos is None or pos.type.tensor_type.elem_type != TensorProto.INT64 \
                    or len(pos.type.tensor_type.shape.dim) != 1:
                return "the angles are not computed from a 1-D int64 graph input (positions)"
            if inv_value.dtype != np.float32 or inv_value.size * 2 != d or inv_value.size != inv_value.shape[-1]:
                return f"inv_freq {inv_value.shape} does not match head_dim {d}"
            return x, inv, heads, d, cos_dtype
        return "inv_freq is not a constant"


def fuse_rotary(g: FusionGraph, cache_rows: int) -> RuleReport:
    report = RuleReport()
    matcher = _Matcher(g)
    caches: dict[tuple[str, int], tuple[str, str]] = {}
    pos_ids: dict[str, str] = {}
    shapes: dict[tuple[int, ...], str] = {}

    def shape_const(dims: tuple[int, ...]) -> str:
        if dims not in shapes:
            shapes[dims] = g.add_init(tensor(np.array(dims, np.int64),
                                             g.unique("rotary_shape_" + "_".join(str(abs(d)) for d in dims))))
        return shapes[dims]

    for add in [n for n in g.nodes if n.op_type == "Add" and n.domain in ("", "ai.onnx")]:
        m = matcher.match(add)
        if m is None:
            continue
        if isinstance(m, str):
            report.miss(add.output[0], m)
            continue
        x, inv, heads, d, dtype = m
        if (inv, dtype) not in caches:
            cos, sin = rope_cache(const_array(g, inv), cache_rows, dtype)  # type: ignore[arg-type]
            caches[inv, dtype] = (g.add_init(tensor(cos, g.unique("rotary_cos_cache"))),
                                  g.add_init(tensor(sin, g.unique("rotary_sin_cache"))))
        # the positions graph input behind this pattern (checked by the matcher)
        positions = _positions_of(matcher, add)
        if positions not in pos_ids:
            axes = g.add_init(tensor(np.array([0], np.int64), g.unique("rotary_position_ids_axes")))
            pos_ids[positions] = g.unique("rotary_position_ids")
            g.nodes.insert(0, helper.make_node("Unsqueeze", [positions, axes], [pos_ids[positions]],
                                               name=g.unique("rotary_position_ids_Unsqueeze")))
        base = add.output[0]
        x3, y3 = g.unique(f"{base}_rotary_input"), g.unique(f"{base}_rotary_output")
        cos_c, sin_c = caches[inv, dtype]
        new = [
            helper.make_node("Reshape", [x, shape_const((1, -1, heads * d))], [x3], name=g.unique(f"{base}_Reshape_in")),
            helper.make_node("RotaryEmbedding", [x3, pos_ids[positions], cos_c, sin_c], [y3],
                             name=g.unique(f"{base}_RotaryEmbedding"), domain=MS_DOMAIN,
                             num_heads=heads, interleaved=0),
            helper.make_node("Reshape", [y3, shape_const((-1, heads, d))], [base], name=g.unique(f"{base}_Reshape_out")),
        ]
        i = g.index(add)
        g.nodes[i:i + 1] = new
        report.fired += 1
    return report


def _positions_of(matcher: _Matcher, add: onnx.NodeProto) -> str:
    for x in add.input:
        mul = matcher.producers[x]
        for y in mul.input:
            trig = matcher.trig(y, "Cos")
            if trig is None:
                continue
            freqs = matcher.producers[matcher.producers[trig.input[0]].input[0]]
            for z in freqs.input:
                u = matcher.prod(z, "Unsqueeze")
                if u is not None:
                    return matcher.producers[u.input[0]].input[0]
    raise AssertionError("matched rotary pattern without positions")  # pragma: no cover
