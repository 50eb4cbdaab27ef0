"""Quantization math (compiler/quant): INT4 groups with a padded last group, FP8 E4M3, GPTQ, AWQ,
calibration selection; each checked against a direct computation or against ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import needs_ort
from onnx import TensorProto, helper, numpy_helper
from onnx_model import make_model

from compiler.passes.base import BuildError
from compiler.quant import awq, fp8, gptq, int4
from compiler.quant.calibration import read_text, select_windows


def _session(nodes: list, inputs: list, outputs: list, inits: list, ms: bool = False) -> ort.InferenceSession:
    opsets = [helper.make_opsetid("", 21)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    model = make_model(helper.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=opsets)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _weight(out: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, cols, generator=g) * 0.05


# ------------------------------------------------------------------------------ INT4


def test_int4_groups_pad_the_last_group_without_using_the_padding() -> None:
    w = _weight(8, 704)
    w[:, 640:] += 3.0  # the short last group (64 columns) has its own range
    q = int4.quantize_rtn(w, 128)
    assert q.codes.shape == (8, 704) and q.scales.shape == (8, 6) and q.zeros.shape == (8, 6)
    assert q.codes.max() <= 15 and q.zeros.max() <= 15
    last = w[:, 640:]
    expect = ((last.amax(1) - last.amin(1).clamp(max=0)) / 15).numpy()  # the range always contains 0
    np.testing.assert_allclose(q.scales[:, 5], expect, rtol=1e-6)
    err = (q.dequantize() - w).abs()
    bound = torch.from_numpy(q.scales).repeat_interleave(128, 1)[:, :704] / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    torch.testing.assert_close(int4.fake_quantize(w, 128), q.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_int4_whole_group_rtn_equals_the_per_column_formula(symmetric: bool, clip: bool) -> None:
    """quantize_rtn's whole-group path (a [out, G, gs] view, per-group values broadcast, in place) gives the
    bits of code = clamp(round(w / scale) + zero, 0, 15) with scale and zero expanded per column."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 512, generator=g) * torch.rand(96, 1, generator=g) * 0.1
    w[0] = 0.0
    w[1] = w[1].abs()
    w[2] = -w[2].abs()
    max_val = (w.abs().reshape(96, 4, 128).amax(-1) * 0.6) if clip else None
    q = int4.quantize_rtn(w, 128, max_val, symmetric)
    scale, zero = int4.group_params(w, 128, max_val, symmetric)
    ref = int4.quantize_codes(w, int4.expand(scale, 512, 128), int4.expand(zero, 512, 128)).to(torch.uint8)
    assert np.array_equal(q.codes, ref.numpy())
    assert np.array_equal(q.scales, scale.numpy()) and np.array_equal(q.zeros, zero.to(torch.uint8).numpy())
    wmin, wmax = int4.group_minmax(w, 128)
    assert torch.equal(wmin, w.reshape(96, 4, 128).amin(-1)) and torch.equal(wmax, w.reshape(96, 4, 128).amax(-1))


def test_int4_clipping_bounds_the_range() -> None:
    w = _weight(4, 256)
    max_val = torch.full((4, 2), 0.02)
    deq = int4.quantize_rtn(w, 128, max_val).dequantize()
    assert float(deq.abs().max()) <= 0.02 + 0.04 / 15  # the range is [-0.02, 0.02] up to one step


@pytest.mark.parametrize("cols", [704, 256])
def test_matmulnbits_and_blocked_dequantizelinear_match_the_torch_dequantization(cols: int) -> None:
    q = int4.quantize_rtn(_weight(48, cols, seed=cols), 128)
    x = np.random.default_rng(0).standard_normal((5, cols)).astype(np.float32)
    ref = x @ q.dequantize().numpy().T
    b, s, z = int4.pack_matmulnbits(q)
    assert b.shape == (48, int4.num_groups(cols, 128), 64)
    xin = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, cols])
    yout = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 48])
    nbits = _session([helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft", K=cols,
                                       N=48, bits=4, block_size=128)], [xin], [yout],
                     [numpy_helper.from_array(b, "B"), numpy_helper.from_array(s, "S"),
                      numpy_helper.from_array(z, "Z")], ms=True)
    np.testing.assert_allclose(nbits.run(None, {"x": x})[0], ref, rtol=1e-4, atol=1e-5)
    qdq = _session([helper.make_node("DequantizeLinear", ["Wq", "S", "Z"], ["W"], axis=1, block_size=128),
                    helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], [xin], [yout],
                   [numpy_helper.from_array(q.codes.astype(ml_dtypes.uint4), "Wq"),
                    numpy_helper.from_array(q.scales, "S"),
                    numpy_helper.from_array(q.zeros.astype(ml_dtypes.uint4), "Z")])
    np.testing.assert_allclose(qdq.run(None, {"x": x})[0], ref, rtol=1e-5, atol=1e-6)


def test_int4_weights_with_scales_and_zeros_take_under_15_percent_of_fp32() -> None:
    for shape in [(256, 256), (64, 256), (704, 256), (256, 704)]:
        b, s, z = int4.pack_matmulnbits(int4.quantize_rtn(_weight(*shape), 128))
        assert (b.nbytes + s.nbytes + z.nbytes) / (shape[0] * shape[1] * 4) <= 0.15, shape


# ------------------------------------------------------------------------------ FP8


def test_fp8_weights_match_ml_dtypes_and_saturate() -> None:
    w = _weight(16, 64)
    q = fp8.quantize_weight(w, per_channel=True)
    scale = (w.abs().amax(1) / 448).numpy()
    np.testing.assert_allclose(q.scales, scale, rtol=1e-6)
    expect = (w.numpy() / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(q.codes, expect.view(np.uint8))
    np.testing.assert_allclose(q.dequantize().numpy(), expect.astype(np.float32) * scale[:, None], rtol=0, atol=0)
    big = fp8.to_e4m3(torch.tensor([1e6, -1e6, 3.0])).to(torch.float32)
    assert big.tolist() == [448.0, -448.0, 3.0]
    t = fp8.quantize_weight(w, per_channel=False)
    assert t.scales.shape == () and np.isfinite(t.dequantize().numpy()).all()


@needs_ort("fp8_activations")
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_fp8_activation_qdq_in_onnx_runtime_matches_torch(mode: str) -> None:
    from compiler.quant import onnx_rules as R
    from compiler.quant.state import QuantizedWeight

    w = _weight(32, 64)
    qw = QuantizedWeight("w", "fp8", fp8.quantize_weight(w), act_mode=mode,
                         act_scale=fp8.activation_scale(3.0) if mode == "static" else None)
    model = make_model(helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], name="gemm", transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 32])],
        [numpy_helper.from_array(w.numpy(), "w")]), opset_imports=[helper.make_opsetid("", 21)])
    g = R.Graph(model)
    assert R.WeightToQdq().check(g, qw) is None
    dq = R.WeightToQdq().rewrite(g, qw)
    assert R.ActivationQdq().check(g, qw, dq.output[0]) is None
    assert R.ActivationQdq().rewrite(g, qw, dq.output[0], {}) == 1
    g.commit()
    onnx.checker.check_model(model, full_check=True)
    x = (np.random.default_rng(1).standard_normal((6, 64)) * 2).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    xt = torch.from_numpy(x)
    scale = torch.tensor(qw.act_scale) if mode == "static" else (xt.abs().amax(1, keepdim=True) / 448)
    ref = fp8.fake_quantize(xt, scale) @ qw.data.dequantize().T
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ GPTQ and AWQ


def _correlated_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5
    scale = torch.exp(torch.randn(cols, generator=g))  # a few large channels, as in LLM activations
    return (torch.randn(n, cols, generator=g) @ mix) * scale


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gptq_reconstructs_the_layer_output_better_than_rtn(act_order: bool, dtype: torch.dtype) -> None:
    cols = 320  # 2.5 groups of 128: the last group is short
    w = _weight(64, cols, seed=3)
    x = _correlated_inputs(2048, cols)
    h = gptq.Hessian(cols, dtype)
    h.add(x)
    q, _ = gptq.gptq_quantize_prepared(w, gptq.prepare(h.value(), 0.01, act_order), 128)
    rtn = int4.quantize_rtn(w, 128)
    err_gptq = float((x @ (q.dequantize() - w).T).pow(2).mean())
    err_rtn = float((x @ (rtn.dequantize() - w).T).pow(2).mean())
    assert err_gptq < 0.7 * err_rtn, (err_gptq, err_rtn)
    if dtype == torch.float32:  # float32 (quantize_gptq's default) reconstructs as well as float64
        h64 = gptq.Hessian(cols)
        h64.add(x)
        q64, _ = gptq.gptq_quantize(w, h64.value(), 128, damp=0.01, act_order=act_order)
        err64 = float((x @ (q64.dequantize() - w).T).pow(2).mean())
        assert abs(err_gptq - err64) < 0.02 * err64, (err_gptq, err64)
        assert float((q.codes != q64.codes).mean()) < 0.02  # a few codes differ by a rounding tie
    # the stored codes, scales and zero points are the weights' exact description (contiguous groups)
    deq = (q.codes.astype(np.float32) - np.repeat(q.zeros, 128, 1)[:, :cols]) * np.repeat(q.scales, 128, 1)[:, :cols]
    np.testing.assert_array_equal(q.dequantize().numpy(), deq)


def test_gptq_handles_dead_inputs_and_refuses_an_empty_hessian() -> None:
    x = _correlated_inputs(512, 128)
    x[:, 5] = 0.0
    h = gptq.Hessian(128)
    h.add(x)
    q, _ = gptq.gptq_quantize(_weight(8, 128), h.value(), 128)
    assert np.isfinite(q.scales).all()
    with pytest.raises(ValueError, match="no calibration input"):
        gptq.Hessian(4).value()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_prepares_the_hessian_in_its_own_storage_as_the_textbook_formula(act_order: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare permutes, dampens, inverts and factors H in place (bands of rows: ADD_ROWS made small here) and
    gets exactly what the copying formula gets: chol((P (H + dead) P^T + damp * mean diag I)^-1) upper."""
    monkeypatch.setattr(gptq, "ADD_ROWS", 48)
    cols = 200
    x = _correlated_inputs(1024, cols, seed=4)
    x[:, 7] = 0.0  # a dead input
    acc = gptq.Hessian(cols)
    acc.add(x)
    h = acc.value()
    ref = h.clone()
    dead = torch.diag(ref) == 0
    ref[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(ref), descending=True, stable=True) if act_order else torch.arange(cols)
    ref = ref[perm][:, perm]
    ref.diagonal().add_(0.01 * torch.mean(torch.diag(ref)))
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(ref)), upper=True)
    ptr = h.data_ptr()
    prep = gptq.prepare(h, 0.01, act_order)
    assert prep.hinv.data_ptr() == ptr  # no second [in, in] matrix
    assert torch.equal(prep.perm, perm) and torch.equal(prep.dead, dead)
    assert torch.equal(prep.hinv, ref)
    # the accumulator's value taken in place equals value(); Hessian.add's bands of the upper triangle, mirrored,
    # equal one X^T X product
    acc2 = gptq.Hessian(cols)
    acc2.add(x)
    assert torch.equal(acc2.take(), acc.value())
    x64 = x.to(torch.float64)
    full = x64.T @ x64 * (2.0 / x.shape[0])
    assert torch.equal(acc.value(), acc.value().T)
    torch.testing.assert_close(acc.value(), full, rtol=1e-12, atol=1e-12)
    band = torch.arange(cols) // gptq.ADD_ROWS  # the accumulator holds the upper triangle of the bands' blocks
    assert not acc.h[band.unsqueeze(1) > band.unsqueeze(0)].any()


def _gptq_textbook(w: torch.Tensor, prep: gptq.Prepared, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ without lazy batches: each column's error pushed onto every later column at once; a group's scale and
    zero from its current weights when its first column comes up. (codes [rows, cols] in processed order, scales)"""
    w = w.to(torch.float64).clone()
    w[:, prep.dead] = 0.0
    w = w[:, prep.perm]
    u = prep.hinv.to(torch.float64)
    rows, cols = w.shape
    gidx = prep.perm // group_size
    scale = torch.zeros(rows, int4.num_groups(cols, group_size), dtype=torch.float64)
    zero = torch.zeros_like(scale)
    done: set[int] = set()
    codes = torch.zeros(rows, cols, dtype=torch.float64)
    for j in range(cols):
        g = int(gidx[j])
        if g not in done:
            cur = w[:, gidx == g]
            sc, zc = int4.params_from_range(cur.amin(1), cur.amax(1))
            scale[:, g], zero[:, g] = sc.double(), zc.double()
            done.add(g)
        q = int4.quantize_codes(w[:, j], scale[:, g], zero[:, g])
        codes[:, j] = q
        e = (w[:, j] - int4.dequantize_codes(q, scale[:, g], zero[:, g])) / u[j, j]
        w[:, j + 1:] -= e.unsqueeze(1) * u[j, j + 1:].unsqueeze(0)
    return codes, scale


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_size", [128, 40])
def test_gptq_lazy_batches_and_sub_batches_equal_the_textbook_loop(act_order: bool, block_size: int) -> None:
    """gptq_quantize_prepared's lazy batches (block_size) and sub-batches (gptq.SUB_BLOCK columns, the rest of the
    batch by one product each) compute what pushing each column's error onto all later columns at once computes."""
    cols = 300
    w = _weight(24, cols, seed=5)
    x = _correlated_inputs(1024, cols, seed=6)
    x[:, 11] = 0.0
    acc = gptq.Hessian(cols)
    acc.add(x)
    prep = gptq.prepare(acc.take(), 0.01, act_order)
    q, _ = gptq.gptq_quantize_prepared(w, prep, 64, block_size=block_size)
    want_codes, want_scale = _gptq_textbook(w, prep, 64)
    got = torch.from_numpy(q.codes.astype(np.float64))[:, prep.perm]
    assert float((got != want_codes).double().mean()) < 1e-3  # a rounding tie may fall the other way
    torch.testing.assert_close(torch.from_numpy(q.scales).double(), want_scale, rtol=1e-6, atol=0)


def test_linears_fed_one_input_share_one_hessian() -> None:
    cols = {"q": 64, "k": 64, "o": 64}
    xs = [_correlated_inputs(256, 64, seed=s) for s in (1, 2, 3, 4)]
    shared = gptq.SharedHessians(cols)
    for a, b in ((xs[0], xs[1]), (xs[2], xs[3])):  # two batches: q and k fed one tensor, o another
        shared.add("q", a)
        shared.add("k", a)
        shared.add("o", b)
    assert shared.of["q"] is shared.of["k"] and shared.of["o"] is not shared.of["q"]
    alone = gptq.Hessian(64)
    alone.add(xs[0])
    alone.add(xs[2])
    assert shared.of["k"].n == 512 and torch.equal(shared.of["k"].value(), alone.value())
    with pytest.raises(RuntimeError, match="k: its input was shared with q"):
        shared.add("q", xs[0])
        shared.add("k", xs[1])  # k fed a tensor q was not


def test_awq_scale_folding_keeps_the_float_function_and_the_search_helps() -> None:
    from compiler.models.llama import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(128, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128) + 0.5)
    lin = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_weight(64, 128))
    x = _correlated_inputs(512, 128, seed=1)
    before = lin(norm(x)).detach()
    group = awq.ScaleGroup("t", norm, [lin], [True], [norm(x).detach()], lambda b, xi: lin(xi))
    s, ratio, loss = awq.search_scale(group, 128, n_grid=10)
    with torch.no_grad():
        plain = float((lin(norm(x)) - torch.nn.functional.linear(norm(x), int4.fake_quantize(lin.weight, 128))
                       ).pow(2).mean())
    assert loss <= plain + 1e-12 and 0 <= ratio < 1
    awq.apply_scale(group, s)
    torch.testing.assert_close(lin(norm(x)).detach(), before, rtol=1e-4, atol=1e-5)
    max_val = awq.search_clip(lin.weight, group.inputs, 128, n_grid=10)
    assert max_val.shape == (64, 1)


def test_awq_fit_forward_is_the_stored_int4_and_gradients_reach_scales_and_clips() -> None:
    """awq_fit's differentiable fake quantization computes exactly the stored weight's dequantized values
    (padded last group, random clipping factors), and the KL fit moves the scales and the clipping."""
    from compiler.quant import awq_fit

    torch.manual_seed(3)
    w = _weight(24, 200)  # 200 = 128 + 72: a short last group
    f_max, f_min = torch.rand(24, 2) * 0.5 + 0.5, torch.rand(24, 2) * 0.5 + 0.5
    q = awq_fit.quantize(w, 128, f_max, f_min)
    assert torch.equal(awq_fit.fake_quantize(w, 128, f_max, f_min), q.dequantize())
    ones = torch.ones(24, 2)
    assert torch.equal(awq_fit.fake_quantize(w, 128, ones, ones), int4.fake_quantize(w, 128))

    # a Linear after a norm-like scale, fitted against its float output's softmax
    lin = torch.nn.Linear(200, 24, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = _correlated_inputs(256, 200, seed=2) * (torch.rand(200) * 4)  # channels of unequal magnitude
    group = awq_fit.FitGroup("g", [("lin", lin, True)])
    result = awq_fit.fit([group], 2, lambda b: lin(x[b::2]), 128, epochs=6, lr_scale=0.05, lr_clip=0.2)
    assert torch.equal(lin.weight, w)  # the Linear's own parameter is back, unchanged
    assert result.kl[-1] < result.kl[0]
    s = result.scales["g"]
    fmax, fmin = result.clips["lin"]
    start = torch.sigmoid(torch.tensor(awq_fit.CLIP_INIT))
    assert not torch.equal(s, torch.ones(200)) and not torch.allclose(fmax, start.expand_as(fmax))
    with torch.no_grad():
        rtn = torch.nn.functional.linear(x, int4.fake_quantize(w, 128))
        fitted = torch.nn.functional.linear(x / s, awq_fit.quantize(w * s, 128, fmax, fmin).dequantize())
    kl = lambda out: float(torch.nn.functional.kl_div(  # noqa: E731
        torch.log_softmax(out, -1), torch.log_softmax(x @ w.T, -1), log_target=True, reduction="batchmean"))
    assert kl(fitted) < kl(rtn), (kl(fitted), kl(rtn))


# ------------------------------------------------------------------------------ calibration


def test_window_selection_is_seeded_sorted_and_checked() -> None:
    a = select_windows(10_000, 256, 8, seed=0)
    assert a == select_windows(10_000, 256, 8, seed=0) and a == sorted(a) and len(set(a)) == 8
    assert all(s % 256 == 0 and s + 256 <= 10_000 for s in a)
    assert a != select_windows(10_000, 256, 8, seed=1)
    with pytest.raises(BuildError, match="num_samples is 50"):
        select_windows(10_000, 256, 50, seed=0)


def test_calibration_budget_defaults_to_128_windows_or_the_whole_file(tmp_path: Path) -> None:
    """No num_samples: 128 windows (demo calib.txt, seq_len 256), every window when the file has fewer
    (seq_len 1024); the manifest record says how the budget was set and how much of the file it used."""
    from conftest import DEMO_MODEL, write_recipe

    from compiler.checkpoint import inspect_checkpoint
    from compiler.passes.base import BuildContext
    from compiler.quant.calibration import load_calibration
    from compiler.recipe import load_recipe

    def record(name: str, calibration: str) -> dict:
        recipe = load_recipe(write_recipe(tmp_path, DEMO_MODEL, name=name,
                                          extra=f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n{calibration}"))
        ctx = BuildContext(recipe=recipe, checkpoint=inspect_checkpoint(DEMO_MODEL), staging=tmp_path)
        cal = load_calibration(ctx, "test")
        assert len(cal.samples) == cal.record["num_samples"]
        return cal.record

    default = record("default", "")
    windows = default["tokens"] // 256
    assert windows > 128 and default["num_samples"] == 128 and default["seq_len"] == 256
    assert default["budget"] == {"tokens": 128 * 256, "set_by": "default (128 windows)", "windows_available": windows,
                                 "windows_used_fraction": round(128 / windows, 4)}
    long = record("long", "  seq_len: 1024\n")
    assert long["num_samples"] == long["budget"]["windows_available"] == default["tokens"] // 1024 < 128
    assert long["budget"]["set_by"].startswith("default: every window")
    assert long["budget"]["windows_used_fraction"] == 1.0
    explicit = record("explicit", "  num_samples: 16\n")
    assert explicit["budget"]["set_by"] == "recipe (calibration.num_samples)" and explicit["budget"]["tokens"] == 4096


def test_jsonl_calibration_joins_the_text_field(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["a = 1", "b = 2"])) + "\n\n")
    assert read_text(f, "text") == "a = 1\n\nb = 2"
    with pytest.raises(BuildError, match=r"c.jsonl:1: no string field 'body'"):
        read_text(f, "body")
    f.write_text('{"text": "x"}\nnot json\n')
    with pytest.raises(BuildError, match=r"c.jsonl:2: invalid JSON"):
        read_text(f, "text")


def test_range_search_never_loses_to_min_max_and_shrinks_outlier_groups() -> None:
    """search_range tries p = 1 first (the min/max range), so its |Q(w) - w|^2.4 per row is at most
    min/max's; a row with one large outlier gets a shrunk range (a smaller scale)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, generator=g, dtype=torch.float64)
    w[3, 5] = 12.0
    scale, zero = int4.search_range(w)
    s0, z0 = int4.params_from_range(w.amin(1), w.amax(1))

    def err(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        s, z = s.double().unsqueeze(1), z.double().unsqueeze(1)
        return (int4.dequantize_codes(int4.quantize_codes(w, s, z), s, z) - w).abs().pow(2.4).sum(1)

    assert bool((err(scale, zero) <= err(s0, z0) + 1e-12).all())
    assert float(err(scale, zero).sum()) < float(err(s0, z0).sum())
    assert scale[3] < s0[3]
    q, _ = gptq.gptq_quantize(w.float(), torch.eye(128, dtype=torch.float64), 128, range_search=True)
    assert q.codes.max() <= 15 and q.scales.shape == (16, 1)


def test_rescaling_rows_of_an_int4_weight_is_exact() -> None:
    """Sequential AWQ folds a later group's scale into the rows of an already quantized Linear (v before o,
    up before down): the codes and zero points stay, the scales of row c are divided by s[c]."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    q = int4.quantize_rtn(w, 128)
    s = torch.linspace(0.5, 2.0, 8)
    r = awq.rescale_rows(q, s)
    assert np.array_equal(r.codes, q.codes) and np.array_equal(r.zeros, q.zeros)
    torch.testing.assert_close(r.dequantize(), q.dequantize() / s.view(-1, 1), rtol=1e-6, atol=1e-7)
