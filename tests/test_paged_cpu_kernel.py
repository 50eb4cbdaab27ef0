"""The C paged-attention kernel (optimize.PagedAttention, runtime/kernels/op_paged_attention.c) in a real
ONNX Runtime session against the reference attention (runtime/kernels/paged_attention.py).

Hypothesis draws whole steps: several sequences mixing prefill chunks (with and without past), decode
tokens and sequences with no new token; block sizes 1/4/16; MHA, GQA and MQA; head dims that are and
are not multiples of the kernel's 16-lane vectors; sliding windows shorter and longer than the context;
block tables in random order with unused (-1) tails. Each step checks the output against the reference
and that the step's K/V landed in the pools at exactly the slots the scheduler would assign, with every
other pool entry untouched. The same cases run with the work split over ONNX Runtime's thread pool
(OPTIMIZE_PAGED_CPU_INLINE_WORK=0) and inline, and on each CPU code path of the ops (avx512, avx2,
baseline: OPTIMIZE_CPU_ISA; a path this CPU lacks is skipped naming the missing features, tests/cpu_paths.py).
Malformed steps are refused before anything is written.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from cpu_paths import cpu_path  # noqa: F401 - the fixture each code path runs under
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx_model import make_model

from runtime.kernels import paged_attention_cpu as pk
from runtime.kernels.paged_attention import paged_attention_reference

TOL = 2e-5  # relative to the output's scale; float32 accumulation, ~2 ulp exp2


def op_model(num_heads: int, kv_heads: int, head_dim: int, scale: float, window: int) -> bytes:
    node = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "past", "bt"], ["o"],
                            domain=pk.DOMAIN, num_heads=num_heads, kv_num_heads=kv_heads, scale=scale,
                            local_window_size=window)
    f = helper.make_tensor_value_info
    inputs = [f("q", TensorProto.FLOAT, ["T", num_heads * head_dim]),
              f("k", TensorProto.FLOAT, ["T", kv_heads * head_dim]),
              f("v", TensorProto.FLOAT, ["T", kv_heads * head_dim]),
              f("kc", TensorProto.FLOAT, ["NB", "BS", kv_heads, head_dim]),
              f("vc", TensorProto.FLOAT, ["NB", "BS", kv_heads, head_dim]),
              f("cu", TensorProto.INT32, ["B1"]), f("past", TensorProto.INT32, ["B"]),
              f("bt", TensorProto.INT32, ["B", "MB"])]
    graph = helper.make_graph([node], "paged", inputs, [f("o", TensorProto.FLOAT, ["T", num_heads * head_dim])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1)])
    return model.SerializeToString()


def session(num_heads: int, kv_heads: int, head_dim: int, scale: float, window: int,
            threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    pk.register(so)
    return ort.InferenceSession(op_model(num_heads, kv_heads, head_dim, scale, window), so,
                                providers=["CPUExecutionProvider"])


def make_step(rng: np.random.Generator, pasts: list[int], news: list[int], block_size: int, kv_heads: int,
              head_dim: int, num_heads: int, spare_blocks: int = 3) -> dict[str, np.ndarray]:
    need = [-(-(p + n) // block_size) for p, n in zip(pasts, news, strict=True)]
    num_blocks = sum(need) + spare_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)  # blocks out of order, some never used
    width = max(need + [1]) + 1  # an unused (-1) tail on every row
    table = np.full((len(pasts), width), -1, np.int32)
    k = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[k:k + n]
        k += n
    t = sum(news)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "q": rng.standard_normal((t, num_heads * head_dim), dtype=np.float32),
        "k": rng.standard_normal((t, kv_heads * head_dim), dtype=np.float32),
        "v": rng.standard_normal((t, kv_heads * head_dim), dtype=np.float32),
        "kc": rng.standard_normal(shape, dtype=np.float32),
        "vc": rng.standard_normal(shape, dtype=np.float32),
        "cu": np.cumsum([0] + news).astype(np.int32),
        "past": np.array(pasts, np.int32),
        "bt": table,
    }


def reference(feeds: dict[str, np.ndarray], num_heads: int, kv_heads: int, window: int, scale: float) -> np.ndarray:
    args = [torch.from_numpy(feeds[n].copy()) for n in ("q", "k", "v", "kc", "vc", "cu", "past", "bt")]
    return paged_attention_reference(*args, num_heads, kv_heads, max(window, 0), scale).numpy()


def written_slots(feeds: dict[str, np.ndarray], block_size: int) -> np.ndarray:
    """The slots the runtime's scheduler assigns to the step's tokens (block_id * block_size + offset)."""
    cu, past, table = feeds["cu"], feeds["past"], feeds["bt"]
    seq = np.repeat(np.arange(len(past)), np.diff(cu))
    pos = past[seq] + (np.arange(cu[-1]) - cu[seq])
    return table[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size


def check_step(feeds: dict[str, np.ndarray], num_heads: int, kv_heads: int, head_dim: int, block_size: int,
               window: int, scale: float, threads: int) -> None:
    want = reference(feeds, num_heads, kv_heads, window, scale)
    kc0, vc0 = feeds["kc"].copy(), feeds["vc"].copy()
    got = session(num_heads, kv_heads, head_dim, scale, window, threads).run(None, feeds)[0]
    assert got.shape == want.shape
    err = np.abs(got - want).max(initial=0.0) / max(1.0, float(np.abs(want).max(initial=0.0)))
    assert err < TOL, f"max relative error {err:.3g}"
    slots = written_slots(feeds, block_size)
    rows = kv_heads * head_dim
    for pool, before, new in ((feeds["kc"], kc0, feeds["k"]), (feeds["vc"], vc0, feeds["v"])):
        flat, flat0 = pool.reshape(-1, rows), before.reshape(-1, rows)
        np.testing.assert_array_equal(flat[slots], new)  # the step's K/V, in place
        keep = np.setdiff1d(np.arange(flat.shape[0]), slots)
        np.testing.assert_array_equal(flat[keep], flat0[keep])  # nothing else touched


@st.composite
def steps(draw: st.DrawFn) -> dict:
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([8, 16, 24, 32, 40, 64]))
    block_size = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 5))
    pasts = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    news = draw(st.lists(st.sampled_from([0, 1, 1, 2, 7, 19, 40]), min_size=n, max_size=n))
    window = draw(st.sampled_from([-1, -1, 1, 5, 33]))
    scale = draw(st.sampled_from([None, 0.05]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(kv_heads=kv_heads, num_heads=kv_heads * group, head_dim=head_dim, block_size=block_size,
                pasts=pasts, news=news, window=window, scale=scale, seed=seed)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("threads", [1, 2], ids=["inline", "thread_pool"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=steps())
def test_kernel_matches_reference_and_writes_the_pools(case: dict, threads: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # thread_pool: every step is split over ONNX Runtime's intra-op pool however small
    monkeypatch.setenv("OPTIMIZE_PAGED_CPU_INLINE_WORK", "0" if threads > 1 else str(1 << 62))
    rng = np.random.default_rng(case["seed"])
    scale = case["scale"] or 1.0 / np.sqrt(case["head_dim"])
    feeds = make_step(rng, case["pasts"], case["news"], case["block_size"], case["kv_heads"], case["head_dim"],
                      case["num_heads"])
    check_step(feeds, case["num_heads"], case["kv_heads"], case["head_dim"], case["block_size"], case["window"],
               float(scale), threads)


@pytest.mark.usefixtures("cpu_path")
def test_long_prefill_and_large_decode_batch_through_the_thread_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes of a real server step: a 300-token prefill beside 24 decode tokens at up to 500 past,
    head_dim 64, GQA 12/4, split over two threads by the default threshold."""
    rng = np.random.default_rng(7)
    pasts = [0] + rng.integers(1, 500, 24).tolist()
    news = [300] + [1] * 24
    feeds = make_step(rng, pasts, news, 16, 4, 64, 12)
    monkeypatch.delenv("OPTIMIZE_PAGED_CPU_INLINE_WORK", raising=False)
    check_step(feeds, 12, 4, 64, 16, -1, 0.125, threads=2)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [36, 64])
def test_prefill_tiles_of_every_pass_shape(group: int, head_dim: int) -> None:
    """Prefill tiles (16 rows or more: the rows in the vector lanes) whose passes fill one, two and three
    row registers, and key chunks cut by the causal diagonal, a sliding window and the past/new boundary:
    sequences of 6 to 40 new tokens after 0 or 37 past, every window kind. head_dim 36 is not a whole
    number of the avx512 path's 8-dimension value tiles, so its per-dimension tail runs too."""
    rng = np.random.default_rng(group * 100 + head_dim)
    pasts, news = [0, 37, 0, 37, 0, 37], [6, 11, 17, 23, 33, 40]
    for window in (-1, 5, 20):
        feeds = make_step(rng, pasts, news, 16, 2, head_dim, 2 * group)
        check_step(feeds, 2 * group, 2, head_dim, 16, window, head_dim ** -0.5, threads=1)


def refused(feeds: dict[str, np.ndarray], match: str, window: int = -1) -> None:
    kc0, vc0 = feeds["kc"].copy(), feeds["vc"].copy()
    with pytest.raises(Exception, match=match):
        session(4, 2, 16, 0.25, window).run(None, feeds)
    np.testing.assert_array_equal(feeds["kc"], kc0)
    np.testing.assert_array_equal(feeds["vc"], vc0)


def test_malformed_steps_are_refused_before_any_write() -> None:
    rng = np.random.default_rng(3)
    base = make_step(rng, [5, 20], [3, 1], 4, 2, 16, 4)
    bad = {k: v.copy() for k, v in base.items()}
    bad["bt"][1, 0] = bad["kc"].shape[0]  # a block outside the pool
    refused(bad, "outside the pool")
    bad = {k: v.copy() for k, v in base.items()}
    bad["bt"][0, 1] = -1  # a block the sequence needs is unassigned
    refused(bad, "outside the pool")
    bad = {k: v.copy() for k, v in base.items()}
    bad["bt"] = bad["bt"][:, :2]  # sequence 1 needs 6 blocks
    refused(bad, "needs 6 blocks")
    bad = {k: v.copy() for k, v in base.items()}
    bad["cu"] = np.array([0, 3, 3], np.int32)  # does not end at T = 4
    refused(bad, "must end at the number of tokens")
    bad = {k: v.copy() for k, v in base.items()}
    bad["past"] = np.array([5, -1], np.int32)
    refused(bad, "must not be negative")
    bad = {k: v.copy() for k, v in base.items()}
    bad["vc"] = bad["vc"][:-1].copy()  # a value pool one block shorter than the key pool
    refused(bad, "value_cache's shape differs")


def test_the_library_refuses_an_older_onnxruntime_and_reports_a_missing_build(monkeypatch) -> None:
    with pytest.raises(pk.KernelLibraryError, match=r">= 1\.20"):
        pk.check_onnxruntime_version("1.19.2")
    pk.check_onnxruntime_version("1.20.0")
    pk.check_onnxruntime_version(ort.__version__)
    pk.library_path.cache_clear()
    monkeypatch.setattr(pk, "MODULE", "runtime.kernels._no_such_library")
    try:
        with pytest.raises(pk.KernelLibraryError, match="not built"):
            pk.library_path()
    finally:
        pk.library_path.cache_clear()


def test_a_graph_with_the_op_does_not_load_without_the_library() -> None:
    """The op exists only through the library: ONNX Runtime alone refuses the graph."""
    with pytest.raises(Exception, match="PagedAttention"):
        ort.InferenceSession(op_model(4, 2, 16, 0.25, -1), providers=["CPUExecutionProvider"])


# ---- optimize.RotaryPagedAttention: the same kernel on the packed QKV, rotating q and k itself -------------


def rope_model(num_heads: int, kv_heads: int, head_dim: int, scale: float, window: int, rotary_dim: int,
               interleaved: int) -> bytes:
    node = helper.make_node("RotaryPagedAttention", ["qkv", "pos", "cos", "sin", "kc", "vc", "cu", "past", "bt"],
                            ["o"], domain=pk.DOMAIN, num_heads=num_heads, kv_num_heads=kv_heads, scale=scale,
                            local_window_size=window, rotary_embedding_dim=rotary_dim, interleaved=interleaved)
    f = helper.make_tensor_value_info
    inputs = [f("qkv", TensorProto.FLOAT, ["T", (num_heads + 2 * kv_heads) * head_dim]),
              f("pos", TensorProto.INT64, ["T"]),
              f("cos", TensorProto.FLOAT, ["P", "R2"]), f("sin", TensorProto.FLOAT, ["P", "R2"]),
              f("kc", TensorProto.FLOAT, ["NB", "BS", kv_heads, head_dim]),
              f("vc", TensorProto.FLOAT, ["NB", "BS", kv_heads, head_dim]),
              f("cu", TensorProto.INT32, ["B1"]), f("past", TensorProto.INT32, ["B"]),
              f("bt", TensorProto.INT32, ["B", "MB"])]
    graph = helper.make_graph([node], "rope_paged", inputs,
                              [f("o", TensorProto.FLOAT, ["T", num_heads * head_dim])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1)])
    return model.SerializeToString()


def rotate(x: np.ndarray, heads: int, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int,
           interleaved: int) -> np.ndarray:
    """x [T, heads * D] with each head's first rotary_dim dims turned by row pos[t] of the caches (float64)."""
    t = x.shape[0]
    h = x.reshape(t, heads, x.shape[1] // heads).astype(np.float64)
    out = h.copy()
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    half = rotary_dim // 2
    if interleaved:
        a, b = h[..., 0:rotary_dim:2], h[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = a * c - b * s, b * c + a * s
    else:
        a, b = h[..., :half], h[..., half:rotary_dim]
        out[..., :half], out[..., half:rotary_dim] = a * c - b * s, b * c + a * s
    return out.reshape(x.shape).astype(np.float32)


@st.composite
def rope_steps(draw: st.DrawFn) -> dict:
    case = draw(steps())
    d = case["head_dim"]
    case["rotary_dim"] = draw(st.sampled_from([0, d, d // 2 // 2 * 2]))  # 0: the whole head
    case["interleaved"] = draw(st.sampled_from([0, 1]))
    return case


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("threads", [1, 2], ids=["inline", "thread_pool"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=rope_steps())
def test_rotary_kernel_matches_rotation_then_reference(case: dict, threads: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """RotaryPagedAttention(qkv) == PagedAttention reference on (rotate(q), rotate(k), v), and the pools hold
    rotate(k) and v at the step's slots. Positions are drawn apart from the slots (the rotation reads
    `positions`, the write follows past_lens), so a mixed-up row shows."""
    monkeypatch.setenv("OPTIMIZE_PAGED_CPU_INLINE_WORK", "0" if threads > 1 else str(1 << 62))
    rng = np.random.default_rng(case["seed"])
    heads, kvh, d = case["num_heads"], case["kv_heads"], case["head_dim"]
    scale = float(case["scale"] or 1.0 / np.sqrt(d))
    r = case["rotary_dim"] or d
    feeds = make_step(rng, case["pasts"], case["news"], case["block_size"], kvh, d, heads)
    t = feeds["q"].shape[0]
    rows = 150
    angles = rng.uniform(0, 2 * np.pi, (rows, r // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = rng.integers(0, rows, t).astype(np.int64)
    rotated = dict(feeds, q=rotate(feeds["q"], heads, pos, cos, sin, r, case["interleaved"]),
                   k=rotate(feeds["k"], kvh, pos, cos, sin, r, case["interleaved"]))
    want = reference(rotated, heads, kvh, case["window"], scale)
    kc0, vc0 = feeds["kc"].copy(), feeds["vc"].copy()
    sess_opts = ort.SessionOptions()
    sess_opts.intra_op_num_threads = threads
    pk.register(sess_opts)
    sess = ort.InferenceSession(rope_model(heads, kvh, d, scale, case["window"], case["rotary_dim"],
                                           case["interleaved"]), sess_opts, providers=["CPUExecutionProvider"])
    rope_feeds = {"qkv": np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=1), "pos": pos, "cos": cos,
                  "sin": sin, **{n: feeds[n] for n in ("kc", "vc", "cu", "past", "bt")}}
    got = sess.run(None, rope_feeds)[0]
    err = np.abs(got - want).max(initial=0.0) / max(1.0, float(np.abs(want).max(initial=0.0)))
    assert err < TOL, f"max relative error {err:.3g}"
    slots = written_slots(feeds, case["block_size"])
    for pool, before, new in ((feeds["kc"], kc0, rotated["k"]), (feeds["vc"], vc0, feeds["v"])):
        flat, flat0 = pool.reshape(-1, kvh * d), before.reshape(-1, kvh * d)
        np.testing.assert_allclose(flat[slots], new, rtol=0, atol=1e-5)
        keep = np.setdiff1d(np.arange(flat.shape[0]), slots)
        np.testing.assert_array_equal(flat[keep], flat0[keep])


def test_rotary_kernel_refuses_positions_outside_the_cache_before_any_write() -> None:
    rng = np.random.default_rng(4)
    feeds = make_step(rng, [5, 20], [3, 1], 4, 2, 16, 4)
    cos = np.ones((8, 8), np.float32)
    rope_feeds = {"qkv": np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=1),
                  "pos": np.array([5, 6, 7, 8], np.int64), "cos": cos, "sin": cos.copy(),
                  **{n: feeds[n] for n in ("kc", "vc", "cu", "past", "bt")}}
    kc0 = feeds["kc"].copy()
    so = ort.SessionOptions()
    pk.register(so)
    sess = ort.InferenceSession(rope_model(4, 2, 16, 0.25, -1, 0, 0), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="position 8 of token 3 is outside the rotary cache of 8 rows"):
        sess.run(None, rope_feeds)
    np.testing.assert_array_equal(feeds["kc"], kc0)
    rope_feeds["pos"][3] = 7
    rope_feeds["cos"] = np.ones((8, 4), np.float32)  # half of the 16 the head needs
    with pytest.raises(Exception, match=r"cos_cache must be \[rows, rotary_embedding_dim / 2 = 8\]"):
        sess.run(None, rope_feeds)
    np.testing.assert_array_equal(feeds["kc"], kc0)


# ---- int8 pools (quantize_kv_cache int8): codes with one scale per KV head ------------------------------------


def int8_model(rope: bool, num_heads: int, kv_heads: int, head_dim: int, scale: float, window: int,
               rotary_dim: int = 0, interleaved: int = 0) -> bytes:
    """The op with int8 pools and its k_scale / v_scale inputs."""
    import onnx

    model = onnx.load_from_string(rope_model(num_heads, kv_heads, head_dim, scale, window, rotary_dim, interleaved)
                                  if rope else op_model(num_heads, kv_heads, head_dim, scale, window))
    g = model.graph
    for inp in g.input:
        if inp.name in ("kc", "vc"):
            inp.type.tensor_type.elem_type = TensorProto.INT8
    g.input.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, ["S"]) for n in ("ks", "vs")])
    g.node[0].input.extend(["ks", "vs"])
    return model.SerializeToString()


def quantize(x: np.ndarray, scales: np.ndarray, kv_heads: int) -> np.ndarray:
    """x [..., kv_heads * D] -> int8 codes per head as QuantizeLinear writes them (x / s, ties to even)."""
    h = x.reshape(*x.shape[:-1], kv_heads, x.shape[-1] // kv_heads)
    return np.clip(np.rint(h / scales[:, None]), -128, 127).astype(np.int8).reshape(x.shape)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("threads", [1, 2], ids=["inline", "thread_pool"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=rope_steps(), rope=st.booleans())
def test_int8_pools_attend_to_the_dequantized_past_and_store_codes(case: dict, rope: bool, threads: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With int8 pools the kernel equals the reference on the dequantized past (code * head scale) and the
    step's own K/V as they are (float32, as the decomposed path attends to them); it writes exactly
    QuantizeLinear's codes of the step's K/V at its slots (rotated keys for the rotary op) and nothing else."""
    monkeypatch.setenv("OPTIMIZE_PAGED_CPU_INLINE_WORK", "0" if threads > 1 else str(1 << 62))
    rng = np.random.default_rng(case["seed"])
    heads, kvh, d, bs = case["num_heads"], case["kv_heads"], case["head_dim"], case["block_size"]
    scale = float(case["scale"] or 1.0 / np.sqrt(d))
    feeds = make_step(rng, case["pasts"], case["news"], bs, kvh, d, heads)
    ks, vs = rng.uniform(0.01, 0.05, kvh).astype(np.float32), rng.uniform(0.01, 0.05, kvh).astype(np.float32)
    kc = rng.integers(-128, 128, feeds["kc"].shape).astype(np.int8)
    vc = rng.integers(-128, 128, feeds["vc"].shape).astype(np.int8)
    k_new = feeds["k"]
    r = case["rotary_dim"] or d
    extra: dict[str, np.ndarray] = {}
    if rope:
        rows = 150
        angles = rng.uniform(0, 2 * np.pi, (rows, r // 2))
        extra = {"pos": rng.integers(0, rows, feeds["q"].shape[0]).astype(np.int64),
                 "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
        k_new = rotate(feeds["k"], kvh, extra["pos"], extra["cos"], extra["sin"], r, case["interleaved"])
    k_codes, v_codes = quantize(k_new, ks, kvh), quantize(feeds["v"], vs, kvh)
    ref_feeds = dict(feeds, q=rotate(feeds["q"], heads, extra["pos"], extra["cos"], extra["sin"], r,
                                     case["interleaved"]) if rope else feeds["q"],
                     k=k_new, kc=kc.astype(np.float32) * ks[:, None], vc=vc.astype(np.float32) * vs[:, None])
    want = reference(ref_feeds, heads, kvh, case["window"], scale)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    pk.register(so)
    sess = ort.InferenceSession(int8_model(rope, heads, kvh, d, scale, case["window"], case["rotary_dim"],
                                           case["interleaved"]), so, providers=["CPUExecutionProvider"])
    kc0, vc0 = kc.copy(), vc.copy()
    run_feeds = {"kc": kc, "vc": vc, "ks": ks, "vs": vs, **{n: feeds[n] for n in ("cu", "past", "bt")}}
    if rope:
        run_feeds.update(extra, qkv=np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=1))
    else:
        run_feeds.update({n: feeds[n] for n in ("q", "k", "v")})
    got = sess.run(None, run_feeds)[0]
    err = np.abs(got - want).max(initial=0.0) / max(1.0, float(np.abs(want).max(initial=0.0)))
    assert err < TOL, f"max relative error {err:.3g}"
    slots = written_slots(feeds, bs)
    for pool, before, codes in ((kc, kc0, k_codes), (vc, vc0, v_codes)):
        flat, flat0 = pool.reshape(-1, kvh * d), before.reshape(-1, kvh * d)
        if rope:  # float32 rotation in the kernel vs float64 here: a code may sit one step away at a tie
            assert np.abs(flat[slots].astype(np.int16) - codes).max(initial=0) <= 1
        else:
            np.testing.assert_array_equal(flat[slots], codes)
        keep = np.setdiff1d(np.arange(flat.shape[0]), slots)
        np.testing.assert_array_equal(flat[keep], flat0[keep])


def test_int8_pools_need_their_scales_and_float_pools_take_none() -> None:
    rng = np.random.default_rng(5)
    feeds = make_step(rng, [5, 20], [3, 1], 4, 2, 16, 4)
    so = ort.SessionOptions()
    pk.register(so)
    sess = ort.InferenceSession(int8_model(False, 4, 2, 16, 0.25, -1), so, providers=["CPUExecutionProvider"])
    kc = np.zeros(feeds["kc"].shape, np.int8)
    base = {**{n: feeds[n] for n in ("q", "k", "v", "cu", "past", "bt")}, "kc": kc, "vc": kc.copy()}
    with pytest.raises(Exception, match="k_scale must have kv_num_heads = 2 entries"):
        sess.run(None, dict(base, ks=np.ones(3, np.float32), vs=np.ones(2, np.float32)))
    with pytest.raises(Exception, match="the KV scales must be positive and finite"):
        sess.run(None, dict(base, ks=np.ones(2, np.float32), vs=np.array([1.0, 0.0], np.float32)))
    assert not kc.any()
    float_with_scales = session(4, 2, 16, 0.25, -1)  # float pools, 8 inputs: fine
    float_with_scales.run(None, feeds)


# ---- optimize.QuantizeRows: the per-token INT8 activation quantization as one node -------------------------


def six_node_quantization() -> bytes:
    """The graph compiler/quant/onnx_rules.py writes for per-token activations (the reference)."""
    from onnx import numpy_helper

    c = numpy_helper.from_array
    inits = [c(np.array([-1], np.int64), "axes"), c(np.array(1 / 127, np.float32), "inv"),
             c(np.array(1e-12, np.float32), "tiny"), c(np.array(1.0, np.float32), "one"),
             c(np.array(128, np.uint8), "zp")]
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("ReduceMax", ["a", "axes"], ["m"], keepdims=1),
             helper.make_node("Mul", ["m", "inv"], ["sd"]), helper.make_node("Max", ["sd", "tiny"], ["s"]),
             helper.make_node("Div", ["x", "s"], ["xs"]), helper.make_node("QuantizeLinear", ["xs", "one", "zp"], ["q"])]
    f = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "rows", [f("x", TensorProto.FLOAT, ["T", "K"])],
                              [f("q", TensorProto.UINT8, ["T", "K"]), f("s", TensorProto.FLOAT, ["T", 1])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


def quantize_rows_model() -> bytes:
    node = helper.make_node("QuantizeRows", ["x"], ["q", "s"], domain=pk.DOMAIN)
    f = helper.make_tensor_value_info
    graph = helper.make_graph([node], "rows", [f("x", TensorProto.FLOAT, ["T", "K"])],
                              [f("q", TensorProto.UINT8, ["T", "K"]), f("s", TensorProto.FLOAT, ["T", 1])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1)])
    return model.SerializeToString()


@pytest.mark.usefixtures("cpu_path")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 300), cols=st.sampled_from([1, 7, 16, 33, 768, 3000]),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]), zero_rows=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_quantize_rows_equals_the_six_nodes_it_replaces(rows: int, cols: int, magnitude: float, zero_rows: bool,
                                                        seed: int) -> None:
    """Codes and scales bit for bit, on rows small and large enough for the thread pool, all-zero rows
    (the 1e-12 floor), tiny and large magnitudes, and values exactly half-way between codes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
    if zero_rows and rows:
        x[rng.integers(0, rows, max(1, rows // 4))] = 0.0
    if rows and cols > 2:  # a row whose scale is exactly 1/127 * 127 = 1: halves round to even
        x[0, :3] = [127.0, 0.5, -2.5]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    pk.register(so)
    got = ort.InferenceSession(quantize_rows_model(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    if rows == 0:  # no rows: the shapes alone (ONNX Runtime 1.30's ReduceMax gives the six nodes' scale as (0, K))
        assert got[0].shape == (0, cols) and got[1].shape == (0, 1), (got[0].shape, got[1].shape)
        return
    want = ort.InferenceSession(six_node_quantization(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])


# ---- optimize.SiluMul: a SwiGLU MLP's Split + SiLU + Mul as one node ------------------------------------------


def silu_mul_models() -> tuple[bytes, bytes]:
    """(the op, the three nodes it replaces as the fuse pass finds them: Split, QuickGelu(alpha 1), Mul)."""
    f = helper.make_tensor_value_info
    io = ([f("x", TensorProto.FLOAT, ["T", "W"])], [f("y", TensorProto.FLOAT, ["T", "I"])])
    op = helper.make_graph([helper.make_node("SiluMul", ["x"], ["y"], domain=pk.DOMAIN)], "silu_mul", *io)
    nodes = [helper.make_node("Split", ["x"], ["g", "u"], axis=-1, num_outputs=2),
             helper.make_node("QuickGelu", ["g"], ["s"], domain="com.microsoft", alpha=1.0),
             helper.make_node("Mul", ["s", "u"], ["y"])]
    three = helper.make_graph(nodes, "three", *io)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1), helper.make_opsetid("com.microsoft", 1)]
    return (make_model(op, opset_imports=opsets).SerializeToString(),
            make_model(three, opset_imports=opsets).SerializeToString())


@pytest.mark.usefixtures("cpu_path")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 300), half=st.sampled_from([1, 5, 16, 37, 2048]),
       magnitude=st.sampled_from([1e-3, 1.0, 30.0, 1e4]), seed=st.integers(0, 2**31 - 1))
def test_silu_mul_against_float64_and_the_three_nodes(rows: int, half: int, magnitude: float, seed: int) -> None:
    """silu(g) * u within 1e-5 relative of float64 (a few ulps where |g| is small; the exponent g * log2(e)
    rounds in float32, 3e-6 relative at g = -60, where silu is 1e-25 of g), on rows inline and on the thread pool, partial
    vectors, and gates far out on both sides (exp(-|g|) underflows: sigmoid 0 or 1, nothing overflows);
    and equal to ONNX Runtime's Split + QuickGelu + Mul within float32 rounding."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 2 * half)) * magnitude).astype(np.float32)
    if rows:
        x[0, :min(half, 4)] = [0.0, -0.0, 200.0, -200.0][:min(half, 4)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    pk.register(so)
    op, three = silu_mul_models()
    got = ort.InferenceSession(op, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == (rows, half) and got.dtype == np.float32
    g, u = x[:, :half].astype(np.float64), x[:, half:].astype(np.float64)
    want = g / (1.0 + np.exp(-np.clip(g, -700, 700))) * u
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)
    ort_nodes = ort.InferenceSession(three, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # MLAS's logistic is a float32 approximation with an absolute error of a few 1e-7 in its tails (measured:
    # 1.5e-7 at g = -17.4, where sigmoid is 2.7e-8; it clamps its input to [-18, 18]), so there ONNX Runtime's
    # product is off by up to that times |g * u|
    tail = 4e-7 * float(np.abs(g * u).max(initial=0.0))
    np.testing.assert_allclose(got, ort_nodes, rtol=1e-5, atol=max(tail, 1e-30))


def scaled_silu_mul_models() -> tuple[bytes, bytes]:
    """(SiluMul(x, s), the two nodes it replaces: SiluMul(Mul(x, s))), s [T, 1] one scale per row."""
    f = helper.make_tensor_value_info
    io = ([f("x", TensorProto.FLOAT, ["T", "W"]), f("s", TensorProto.FLOAT, ["T", 1])],
          [f("y", TensorProto.FLOAT, ["T", "I"])])
    op = helper.make_graph([helper.make_node("SiluMul", ["x", "s"], ["y"], domain=pk.DOMAIN)], "scaled", *io)
    two = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["xs"]),
                             helper.make_node("SiluMul", ["xs"], ["y"], domain=pk.DOMAIN)], "two", *io)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1)]
    return (make_model(op, opset_imports=opsets).SerializeToString(),
            make_model(two, opset_imports=opsets).SerializeToString())


@pytest.mark.usefixtures("cpu_path")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 300), half=st.sampled_from([1, 5, 16, 37, 2048]),
       magnitude=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_silu_mul_with_a_row_scale_equals_the_mul_it_replaces(rows: int, half: int, magnitude: float,
                                                              seed: int) -> None:
    """SiluMul(x, s) is bit-identical to ONNX Runtime's Mul(x, s) followed by SiluMul (compiler/fusion/
    row_scale.py relies on it), on rows inline and on the thread pool, whole and partial vectors; scales
    as QuantizeRows writes them (|x| max / 127, at least 1e-12) and a few extreme ones."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-127, 128, size=(rows, 2 * half)).astype(np.float32) * np.float32(magnitude)
    s = (np.abs(rng.standard_normal((rows, 1))) / 127 + 1e-12).astype(np.float32)
    if rows:
        s[0, 0] = np.float32(1e-12)
        s[-1, 0] = np.float32(3.0e3)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    pk.register(so)
    op, two = scaled_silu_mul_models()
    got = ort.InferenceSession(op, so, providers=["CPUExecutionProvider"]).run(None, {"x": x, "s": s})[0]
    want = ort.InferenceSession(two, so, providers=["CPUExecutionProvider"]).run(None, {"x": x, "s": s})[0]
    assert got.shape == (rows, half)
    np.testing.assert_array_equal(got, want)
    xs = x.astype(np.float64) * s  # and against float64 within SiluMul's own 1e-5
    g, u = (x * s)[:, :half].astype(np.float64), xs[:, half:]
    np.testing.assert_allclose(got, g / (1.0 + np.exp(-np.clip(g, -700, 700))) * u, rtol=1e-5, atol=1e-30)


def test_silu_mul_refuses_a_scale_that_is_not_one_per_row() -> None:
    so = ort.SessionOptions()
    pk.register(so)
    sess = ort.InferenceSession(scaled_silu_mul_models()[0], so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="one value per row"):
        sess.run(None, {"x": np.zeros((3, 8), np.float32), "s": np.ones((2, 1), np.float32)})


def test_silu_mul_refuses_an_odd_width() -> None:
    so = ort.SessionOptions()
    pk.register(so)
    sess = ort.InferenceSession(silu_mul_models()[0], so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="must be even"):
        sess.run(None, {"x": np.zeros((2, 7), np.float32)})


# ---- optimize.SkipNormQuantize: row-scale Mul + SkipSimplifiedLayerNormalization + QuantizeRows as one node --


def skip_norm_quantize_models(scaled: bool, epsilon: float) -> tuple[bytes, bytes]:
    """(the op, the nodes it replaces as compiler/fusion/skip_norm_quantize.py finds them)."""
    f = helper.make_tensor_value_info
    inputs = [f("x", TensorProto.FLOAT, ["T", "D"]), f("skip", TensorProto.FLOAT, ["T", "D"]),
              f("gamma", TensorProto.FLOAT, ["D"])] + ([f("s", TensorProto.FLOAT, ["T", 1])] if scaled else [])
    outputs = [f("q", TensorProto.UINT8, ["T", "D"]), f("scale", TensorProto.FLOAT, ["T", 1]),
               f("sum", TensorProto.FLOAT, ["T", "D"])]
    op = helper.make_node("SkipNormQuantize", [i.name for i in inputs], ["q", "scale", "sum"], domain=pk.DOMAIN,
                          epsilon=epsilon)
    nodes = ([helper.make_node("Mul", ["x", "s"], ["xs"])] if scaled else []) + [
        helper.make_node("SkipSimplifiedLayerNormalization", ["xs" if scaled else "x", "skip", "gamma"],
                         ["n", "", "", "sum"], domain="com.microsoft", epsilon=epsilon),
        helper.make_node("QuantizeRows", ["n"], ["q", "scale"], domain=pk.DOMAIN)]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1), helper.make_opsetid("com.microsoft", 1)]
    return (make_model(helper.make_graph([op], "fused", inputs, outputs), opset_imports=opsets)
            .SerializeToString(),
            make_model(helper.make_graph(nodes, "three", inputs, outputs), opset_imports=opsets)
            .SerializeToString())


@pytest.mark.usefixtures("cpu_path")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 300), cols=st.sampled_from([1, 7, 16, 33, 768, 3000]), scaled=st.booleans(),
       magnitude=st.sampled_from([1e-3, 1.0, 1e3]), epsilon=st.sampled_from([1e-6, 1e-5, 0.0]),
       seed=st.integers(0, 2**31 - 1))
def test_skip_norm_quantize_equals_the_three_nodes_it_replaces(rows: int, cols: int, scaled: bool, magnitude: float,
                                                              epsilon: float, seed: int) -> None:
    """Codes, scales and residual sums bit for bit against ONNX Runtime's Mul + SkipSimplifiedLayerNormalization
    + QuantizeRows, with and without the row scale, on rows inline and on the thread pool (groups of four rows
    and their remainders, whole and partial vectors), random gamma, all-zero rows, and every epsilon."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
    skip = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
    gamma = rng.standard_normal(cols).astype(np.float32)
    s = (np.abs(rng.standard_normal((rows, 1))) / 127 + 1e-12).astype(np.float32)
    if rows > 1:
        x[1], skip[1] = 0.0, 0.0  # rms = sqrt(epsilon): with epsilon 0, 0 / 0 in both
    feed = {"x": x, "skip": skip, "gamma": gamma} | ({"s": s} if scaled else {})
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    pk.register(so)
    op, three = skip_norm_quantize_models(scaled, epsilon)
    got = ort.InferenceSession(op, so, providers=["CPUExecutionProvider"]).run(None, feed)
    want = ort.InferenceSession(three, so, providers=["CPUExecutionProvider"]).run(None, feed)
    assert got[0].shape == (rows, cols) and got[1].shape == (rows, 1) and got[2].shape == (rows, cols)
    for name, g, w in zip(("codes", "scale", "sum"), got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)
    if rows and cols > 1:  # and the arithmetic itself, in float64: the normalized row within float32 rounding
        total = x.astype(np.float64) * (s if scaled else 1.0) + skip
        rms = np.sqrt((total**2).mean(axis=1, keepdims=True) + epsilon)
        normed = total / np.where(rms > 0, rms, 1.0) * gamma
        amax = np.abs(normed).max(axis=1, keepdims=True)
        live = (rms[:, 0] > 0) & (amax[:, 0] > 1e-6)
        np.testing.assert_allclose(got[1][live], amax[live] / 127, rtol=1e-5)
        dequant = (got[0].astype(np.float64) - 128) * got[1]
        assert np.all(np.abs(dequant - normed)[live] <= got[1][live] * 0.5 + amax[live] * 1e-5)


def test_skip_norm_quantize_refuses_mismatched_inputs() -> None:
    so = ort.SessionOptions()
    pk.register(so)
    sess = ort.InferenceSession(skip_norm_quantize_models(True, 1e-5)[0], so, providers=["CPUExecutionProvider"])
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(Exception, match="one value per row"):
        sess.run(None, {"x": x, "skip": x, "gamma": np.ones(8, np.float32), "s": np.ones((2, 1), np.float32)})
    with pytest.raises(Exception, match="skip must have x's shape"):
        sess.run(None, {"x": x, "skip": x[:2], "gamma": np.ones(8, np.float32), "s": np.ones((3, 1), np.float32)})
    with pytest.raises(Exception, match="gamma must be"):
        sess.run(None, {"x": x, "skip": x, "gamma": np.ones(7, np.float32), "s": np.ones((3, 1), np.float32)})
