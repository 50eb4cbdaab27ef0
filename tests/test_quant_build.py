"""Quantized builds end to end: the example recipes on the demo model (INT4 RTN/AWQ/GPTQ, FP8), the
accuracy gate, reproducibility, and KV-cache / QDQ-format builds of a small random model.

The demo builds take about a minute each on 2 cores (torch.export and the ONNX exporter dominate),
so they are marked slow and shared through a module fixture that builds a recipe on first use.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import DEMO_MODEL, ROOT, make_random_checkpoint, needs_ort, write_recipe
from onnx import numpy_helper

from compiler.build import build, plan
from compiler.recipe import RecipeError

RECIPES = {m: ROOT / "recipes" / f"demo-{m}.yaml" for m in ("int4-rtn", "int4-awq", "int4-gptq", "fp8")}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The example recipes leave the gate's evaluation size to its rule (up to the whole eval.txt, minutes
# per build); here the gate scores the first 8,192 tokens (32 chunks: the change's se is ~0.17 % for
# INT4, so its 95 % interval is ~+-0.33 %) against a change bound that such an interval can judge.
GATE_TOKENS = 8192
GATE_BOUND_PCT = {"int4-rtn": 2.0, "int4-awq": 1.5, "int4-gptq": 1.0, "fp8": 0.75}
# The AWQ recipe's fit (every calibration window, 20 epochs: about 10 minutes on 2 cores) is its accuracy
# claim, measured on the whole eval.txt by bench/quant.py; here the same recipe fits a quarter of the windows
# for 8 epochs (the same code path, about a third of the time) and must still beat round-to-nearest. At 4
# epochs the fit had not settled: on an AVX-512 CPU it ended at +1.23 % (worse than RTN's +1.07 %), at 8
# epochs +0.84 % there (128 windows x 4 epochs: +0.83 %).
SUITE_SETTINGS = {"int4-awq": {r"(?m)^      fit_epochs: 20$": "      fit_epochs: 8",
                               r"(?m)^  num_samples: 232 .*$": "  num_samples: 64"}}


def gate_subset_recipe(method: str, folder: Path) -> Path:
    """recipes/demo-<method>.yaml with absolute paths, max_eval_tokens GATE_TOKENS, the change bound
    GATE_BOUND_PCT[method] and SUITE_SETTINGS[method]."""
    text = RECIPES[method].read_text(encoding="utf-8").replace("../models/", f"{ROOT}/models/")
    text = re.sub(r"(?m)^  max_perplexity_increase_pct: .*$",
                  f"  max_perplexity_increase_pct: {GATE_BOUND_PCT[method]}\n  max_eval_tokens: {GATE_TOKENS}", text)
    for pattern, value in SUITE_SETTINGS.get(method, {}).items():
        text, n = re.subn(pattern, value, text)
        assert n == 1, (method, pattern)
    assert f"max_eval_tokens: {GATE_TOKENS}" in text  # the example recipes leave it to the gate:
    assert not re.search(r"(?m)^\s*max_eval_tokens:", RECIPES[method].read_text(encoding="utf-8"))
    path = folder / f"demo-{method}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> object:
    """demo(method) -> the artifact of recipes/demo-<method>.yaml (gate on GATE_TOKENS), built once per module."""
    out = tmp_path_factory.mktemp("quant-demo")
    built: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in built:
            built[method] = build(gate_subset_recipe(method, out), progress=False, output=out)
        return built[method]

    return get


def _manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def _metrics(artifact: Path) -> dict:
    return _manifest(artifact)["quality"]["metrics"]


def _pass_stats(artifact: Path, name: str) -> dict:
    return next(p["stats"] for p in _manifest(artifact)["passes"] if p["name"] == name)


def _graph(artifact: Path) -> onnx.ModelProto:
    onnx.checker.check_model(str(artifact / "model.onnx"), full_check=True)
    return onnx.load(str(artifact / "model.onnx"))


@pytest.mark.slow
def test_int4_awq_and_gptq_beat_rtn_with_every_linear_but_lm_head_in_matmulnbits(demo: object) -> None:
    rtn, awq, gptq = (_metrics(demo(m)) for m in ("int4-rtn", "int4-awq", "int4-gptq"))  # type: ignore[operator]
    assert awq["perplexity"] < rtn["perplexity"], (awq, rtn)
    assert gptq["perplexity"] < rtn["perplexity"], (gptq, rtn)
    assert gptq["perplexity_increase_pct"] <= 0.5, gptq
    assert awq["perplexity_increase_pct"] <= 1.0, awq
    for method in ("int4-rtn", "int4-awq", "int4-gptq"):
        artifact = demo(method)  # type: ignore[operator]
        stats = _pass_stats(artifact, f"quantize_{method.split('-')[1]}")
        expect = sorted(f"layers.{i}.{'mlp' if n in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{n}"
                        for i in range(6) for n in LINEARS)
        assert stats["quantized"] == expect and stats["not_quantized"]["lm_head"] == "ignore pattern"
        model = _graph(artifact)
        nodes = model.graph.node
        nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
        assert len(nbits) == 42
        gemms = [n for n in nodes if n.op_type == "Gemm"]
        assert [n.input[1] for n in gemms] == ["lm_head.weight"]  # the only float Linear left
        inits = {t.name: t for t in model.graph.initializer}
        quant_bytes = fp32_bytes = 0
        for n in nbits:
            k = next(a.i for a in n.attribute if a.name == "K")
            nn_ = next(a.i for a in n.attribute if a.name == "N")
            fp32_bytes += k * nn_ * 4
            quant_bytes += sum(numpy_helper.to_array(inits[x]).nbytes for x in n.input[1:4])
        down = [n for n in nbits if "down_proj" in n.input[1]]
        assert len(down) == 6 and all(next(a.i for a in n.attribute if a.name == "K") == 704 for n in down)
        assert quant_bytes / fp32_bytes <= 0.15, (method, quant_bytes / fp32_bytes)


@needs_ort("fp8_activations")
@pytest.mark.slow
def test_fp8_weights_and_activations_within_half_a_percent(demo: object) -> None:
    artifact = demo("fp8")  # type: ignore[operator]
    m = _metrics(artifact)
    assert m["perplexity_increase_pct"] <= 0.5, m
    model = _graph(artifact)
    ops = [n.op_type for n in model.graph.node]
    inits = {t.name: t for t in model.graph.initializer}
    fp8_weights = [t for t in inits.values() if t.data_type == onnx.TensorProto.FLOAT8E4M3FN and t.name.endswith(
        "weight_quantized")]
    assert len(fp8_weights) == 42
    assert ops.count("QuantizeLinear") >= 24  # one per distinct Linear input: qkv, o, gate/up, down x 6
    assert "lm_head.weight" in inits and inits["embed_tokens.weight"].data_type == onnx.TensorProto.FLOAT


# ------------------------------------------------------------------------------ small random model


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("quant-small")
    return folder, make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=7)


def _small_recipe(folder: Path, ckpt: Path, name: str, passes: str, bounds: str = "") -> Path:
    extra = (f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 4\n  seq_len: 128\n"
             f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 1024\n{bounds}")
    return write_recipe(folder, ckpt, name=name, passes=passes, extra=extra)


@pytest.mark.parametrize("dtype,storage", [("int8", np.int8),
                                           pytest.param("fp8", np.uint8, marks=needs_ort("fp8_kv_cache"))])
def test_quantized_kv_cache_runs_in_the_runtime(small: tuple[Path, Path], dtype: str, storage: type,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import LLM
    from runtime.sampling import SamplingParams

    folder, ckpt = small
    recipe = _small_recipe(folder, ckpt, f"kv-{dtype}",
                           "  - name: capture\n  - name: quantize_kv_cache\n    options:\n"
                           f"      dtype: {dtype}\n  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n",
                           "  min_token_agreement: 0.9\n")
    artifact = build(recipe, progress=False)
    runtime_json = json.loads((artifact / "runtime.json").read_text())
    assert runtime_json["kv_cache"]["dtype"] == ("int8" if dtype == "int8" else "float8_e4m3fn")
    assert _manifest(artifact)["target"]["kv_cache_dtype"] == runtime_json["kv_cache"]["dtype"]
    m = _metrics(artifact)
    assert m["token_agreement"] >= 0.9 and m["decode_kl_divergence"] > 0  # decoded through the quantized pool
    assert abs(m["perplexity_increase_pct"]) < 1e-3  # prefill-only chunks do not read the cache
    model = _graph(artifact)
    assert {i.name: i.type.tensor_type.elem_type for i in model.graph.input}["key_cache.0"] == (
        onnx.TensorProto.INT8 if dtype == "int8" else onnx.TensorProto.UINT8)
    llm = LLM(artifact)
    assert llm.engine.backend.k_pools[0].dtype == storage
    outs = llm.generate(["def f(x):\n    return", "import"], SamplingParams(max_tokens=24, temperature=0.0,
                                                                            ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in outs)
    if dtype == "fp8":  # an ONNX Runtime before 1.24 cannot return the step's float8 K/V: said at load
        import onnxruntime

        monkeypatch.setattr(onnxruntime, "__version__", "1.23.2")
        with pytest.raises(RuntimeError, match=r"model.onnx: an FP8 KV cache: needs onnxruntime >= 1.24, and this "
                                               r"is onnxruntime 1.23.2"):
            LLM(artifact)


def test_int4_qdq_format_keeps_blocked_dequantizelinear(small: tuple[Path, Path]) -> None:
    folder, ckpt = small
    recipe = _small_recipe(folder, ckpt, "rtn-qdq",
                           "  - name: capture\n  - name: quantize_rtn\n    options:\n      group_size: 32\n"
                           "  - name: lower_onnx\n  - name: lower_quant\n    options:\n      int4_format: qdq\n"
                           "  - name: package\n", "  min_token_agreement: 0.5\n")
    artifact = build(recipe, progress=False)
    model = _graph(artifact)
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 14 and not [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    inits = {t.name: t for t in model.graph.initializer}
    assert all(inits[n.input[0]].data_type == onnx.TensorProto.UINT4 for n in dqs)
    assert all(next(a.i for a in n.attribute if a.name == "block_size") == 32 for n in dqs)
    stats = _pass_stats(artifact, "lower_quant")
    assert stats["int4_format"] == "qdq" and stats["quantized_weights"] == 14


@needs_ort("fp8_activations")
@pytest.mark.slow
def test_fp8_dynamic_activations_and_fp8_embeddings(small: tuple[Path, Path]) -> None:
    folder, ckpt = small
    recipe = _small_recipe(folder, ckpt, "fp8-dynamic",
                           "  - name: capture\n  - name: quantize_fp8\n    options:\n      activations: dynamic\n"
                           "      ignore: [lm_head]\n  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n",
                           "  max_kl_divergence: 0.01\n")
    artifact = build(recipe, progress=False)
    model = _graph(artifact)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ReduceMax") == ops.count("QuantizeLinear") == 8  # per token: qkv, o, gate/up, down x 2
    inits = {t.name: t for t in model.graph.initializer}
    assert inits["embed_tokens.weight_quantized"].data_type == onnx.TensorProto.FLOAT8E4M3FN
    assert "lm_head.weight" in inits
    stats = _pass_stats(artifact, "quantize_fp8")
    assert stats["quantized_count"] == 15 and stats["not_quantized"] == {"lm_head": "ignore pattern"}


# ------------------------------------------------------------------------------ recipe checks (no build)


@pytest.mark.parametrize("passes,message", [
    ("  - name: capture\n  - name: quantize_rtn\n  - name: lower_onnx\n  - name: package\n",
     "needs 'lower_quant' later in the list"),
    ("  - name: capture\n  - name: quantize_rtn\n  - name: quantize_gptq\n  - name: lower_onnx\n"
     "  - name: lower_quant\n  - name: package\n", "use one of them"),
    ("  - name: capture\n  - name: lower_onnx\n  - name: quantize_rtn\n  - name: lower_quant\n  - name: package\n",
     "must come before lower_onnx"),
    ("  - name: capture\n  - name: quantize_awq\n  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n",
     "needs calibration data"),
])
def test_plan_refuses_quantization_recipes_that_cannot_work(tmp_path: Path, passes: str, message: str) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, passes=passes)
    with pytest.raises(RecipeError, match=message) as e:
        plan(recipe)
    assert e.value.line is not None and e.value.field.startswith("passes[")


@pytest.mark.parametrize("options,message", [
    ("      group_size: 100\n", "power of two"),
    ("      damp: 0\n", "damp must be in"),
    ("      rounding: stochastic\n", "rounding must be 'nearest' or 'gptq'"),
    ("      duo_scaling: sometimes\n", "duo_scaling must be"),
    ("      search: fit\n      rounding: gptq\n", "search 'fit' fits the whole model"),
    ("      search: everything\n      rounding: nearest\n", "search must be 'grid' or 'fit'"),
])
def test_quantizer_options_are_checked(tmp_path: Path, options: str, message: str) -> None:
    method = "awq" if "rounding" in options or "duo_scaling" in options else "gptq"
    passes = f"  - name: capture\n  - name: quantize_{method}\n    options:\n{options}  - name: lower_onnx\n" \
             "  - name: lower_quant\n  - name: package\n"
    recipe = write_recipe(tmp_path, DEMO_MODEL, passes=passes,
                          extra=f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n")
    with pytest.raises(RecipeError, match=message):
        plan(recipe)


def test_calibration_file_must_exist(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, extra="calibration:\n  data: missing.jsonl\n")
    with pytest.raises(RecipeError, match="calibration data file not found") as e:
        plan(recipe)
    assert e.value.field == "calibration.data"


@pytest.mark.parametrize("method,options", [
    ("awq", "      group_size: 32\n      n_grid: 10\n      clip: true\n"),
    ("awq", "      group_size: 32\n      n_grid: 10\n      sequential: true\n      duo_scaling: both\n"),
    ("awq", "      group_size: 32\n      n_grid: 10\n      sequential: true\n      rounding: gptq\n"),
    ("awq", "      group_size: 32\n      search: fit\n      fit_epochs: 2\n"),
    ("gptq", "      group_size: 32\n      act_order: true\n"),
    ("gptq", "      group_size: 32\n      act_order: true\n      range_search: true\n"),
])
def test_same_recipe_and_calibration_give_byte_identical_quantized_weights(small: tuple[Path, Path], method: str,
                                                                          options: str) -> None:
    """A second AWQ / GPTQ run (in process) produces exactly the bytes in the built artifact (RTN goes
    through the same packing code without calibration)."""
    import torch

    from compiler.checkpoint import load_weights
    from compiler.models.llama import LlamaForwardBatchModel
    from compiler.passes import BuildContext
    from compiler.quant.int4 import pack_matmulnbits

    folder, ckpt = small
    recipe = _small_recipe(folder, ckpt, f"identical-{method}-{len(options)}",
                           f"  - name: capture\n  - name: quantize_{method}\n    options:\n{options}"
                           "  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n")
    artifact = build(recipe, progress=False)
    p = plan(recipe)
    ctx = BuildContext(recipe=p.recipe, checkpoint=p.checkpoint, staging=artifact)
    model = LlamaForwardBatchModel(p.checkpoint.config, p.recipe.runtime.kv_block_size)
    model.load_hf_state_dict(load_weights(p.checkpoint), torch.float32)
    ctx.artifacts["model"] = model.eval()
    ctx.completed.append("capture")
    quant = next(ps for ps in p.passes if ps.name.startswith("quantize_"))
    stats = quant.run(ctx)
    assert stats["calibration"] == _pass_stats(artifact, quant.name)["calibration"]
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(artifact / "model.onnx")).graph.initializer}
    weights = ctx.artifacts["quant"].weights
    assert len(weights) == 14  # every Linear of the 2 layers (lm_head too: no ignore list here)
    for name, q in weights.items():
        b, s_, z = pack_matmulnbits(q.data)
        assert np.array_equal(inits[f"{name}_nbits"], b), name
        assert inits[f"{name}_nbits_scales"].tobytes() == s_.tobytes(), name
        assert np.array_equal(inits[f"{name}_nbits_zero_points"], z), name


def test_impossible_bound_fails_the_build_with_the_table_and_no_artifact(small: tuple[Path, Path]) -> None:
    """RTN INT4 against a 0.01 % perplexity bound: `optimize build` exits 1 with measured vs allowed for
    every bound and writes nothing."""
    folder, ckpt = small
    recipe = _small_recipe(folder, ckpt, "rtn-impossible",
                           "  - name: capture\n  - name: quantize_rtn\n    options:\n      group_size: 32\n"
                           "  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n",
                           "  max_perplexity_increase_pct: 0.01\n  max_kl_divergence: 1.0\n"
                           "  min_token_agreement: 0.1\n")
    out = folder / "impossible-out"
    res = subprocess.run([sys.executable, "-m", "compiler.cli", "build", "--no-progress", str(recipe), "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr
    assert "quality gate failed" in err and "no artifact was written" in err, err
    row = next(ln for ln in err.splitlines() if ln.strip().startswith("perplexity increase %"))
    assert "FAILED" in row and "0.0100" in row and "95% interval" in row, row
    assert float(row.split("measured")[1].split()[0]) > 0.01
    for name in ("KL divergence", "token agreement (min)"):  # the bounds that held are in the table too
        line = next(ln for ln in err.splitlines() if ln.strip().startswith(name))
        assert line.rstrip().endswith("ok"), line
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


def test_gate_sizes_its_evaluation_and_records_the_change_with_its_interval(small: tuple[Path, Path]) -> None:
    """No max_eval_tokens: the gate scores its 32-chunk pilot, which judges a loose bound; the manifest has
    the change, its se from the paired chunks, the 95 % interval around it, the verdict and the sizing."""
    folder, ckpt = small
    extra = (f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_perplexity_increase_pct: 1000.0\n")
    recipe = write_recipe(folder, ckpt, name="rtn-auto-size",
                          passes="  - name: capture\n  - name: quantize_rtn\n    options:\n      group_size: 32\n"
                                 "  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n", extra=extra)
    m = _metrics(build(recipe, progress=False))
    assert (m["eval_chunks"], m["eval_tokens"], m["predictions"]) == (32, 8192, 32 * 255)
    assert m["eval_size"]["rule"].startswith("auto") and m["eval_size"]["pilot_chunks"] == 32
    assert m["eval_size"]["needed_chunks"] == 32 and m["eval_size"]["available_chunks"] > 300
    lo, hi = m["perplexity_increase_ci_pct"]
    assert lo < m["perplexity_increase_pct"] < hi and m["perplexity_increase_se_pct"] > 0
    assert m["perplexity_increase_z"] == 1.96 and m["perplexity_increase_verdict"] == "within"
    assert m["perplexity_increase_pct"] == pytest.approx(100 * (m["perplexity"] / m["reference_perplexity"] - 1),
                                                         abs=2e-3)


def test_symmetric_int4_builds_in_both_forms_with_the_same_logits(small: tuple[Path, Path]) -> None:
    """quantize_rtn symmetric: true -> signed int4 DequantizeLinear without zero point (int4_format: qdq,
    the TensorRT form) and MatMulNBits without zero points (8, its default); one set of weights, the same
    logits."""
    from test_torch_fp8 import _batch

    from runtime.engine import LLMEngine

    folder, ckpt = small
    built = {}
    for fmt in ("qdq", "matmulnbits"):
        recipe = _small_recipe(folder, ckpt, f"sym-{fmt}",
                               "  - name: capture\n  - name: quantize_rtn\n    options:\n      group_size: 32\n"
                               "      symmetric: true\n  - name: lower_onnx\n  - name: lower_quant\n    options:\n"
                               f"      int4_format: {fmt}\n      accuracy_level: 0\n"  # float compute: same logits
                               + ("  - name: fuse\n" if fmt == "matmulnbits" else "")  # q|k|v, gate|up concatenated
                               + "  - name: package\n")
        built[fmt] = build(recipe, progress=False)
    assert _pass_stats(built["qdq"], "quantize_rtn")["symmetric"] is True
    model = _graph(built["qdq"])
    types = {t.name: t.data_type for t in model.graph.initializer}
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 14 and all(len(n.input) == 2 and types[n.input[0]] == onnx.TensorProto.INT4 for n in dqs)
    nbits = [n for n in onnx.load(str(built["matmulnbits"] / "model.onnx"), load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) == 3 for n in nbits)  # A, B, scales: no zero points
    assert len(nbits) < 14  # fused: q|k|v and gate|up each one node
    fb = _batch()
    np.testing.assert_allclose(LLMEngine(built["qdq"]).backend.forward(fb),
                               LLMEngine(built["matmulnbits"]).backend.forward(fb), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_diff_fp32_demo_against_int4_awq_demo(demo: object, demo_artifact: Path) -> None:
    """`optimize diff` names the quantization passes, the quality delta and the size change."""
    from click.testing import CliRunner

    from compiler.cli import main
    from compiler.publish import diff_artifacts

    awq = demo("int4-awq")  # type: ignore[operator]
    d = diff_artifacts(str(demo_artifact), str(awq))
    added = {p["pass"] for p in d["passes"] if p["change"] == "added"}
    assert {"quantize_awq", "lower_quant"} <= added
    assert d["quantization"]["quantize_awq"] == _pass_stats(awq, "quantize_awq")
    ppl = next(q for q in d["quality"] if q["metric"] == "perplexity")
    assert ppl["a"] == _metrics(demo_artifact)["perplexity"] and ppl["b"] == _metrics(awq)["perplexity"]
    assert ppl["delta"] == pytest.approx(ppl["b"] - ppl["a"]) and ppl["delta"] > 0
    size_a = sum(f["bytes"] for f in _manifest(demo_artifact)["files"])
    size_b = sum(f["bytes"] for f in _manifest(awq)["files"])
    assert d["size"] == {"a": size_a, "b": size_b, "delta": size_b - size_a, "ratio": round(size_b / size_a, 4)}
    assert size_b < size_a / 2
    assert any(f["path"] == "model.onnx" and f["change"] == "changed" for f in d["files"])

    r = CliRunner().invoke(main, ["diff", str(demo_artifact), str(awq)])
    assert r.exit_code == 0, r.output
    assert "+ quantize_awq" in r.output and "+ lower_quant" in r.output
    assert re.search(rf"perplexity\s+{ppl['a']:.6g}\s+{ppl['b']:.6g}\s+{ppl['delta']:.6g}", r.output), r.output
    assert f"({size_b - size_a:+d} bytes" in r.output
    r = CliRunner().invoke(main, ["diff", str(demo_artifact), str(awq), "--json"])
    assert json.loads(r.output)["size"]["delta"] == size_b - size_a
