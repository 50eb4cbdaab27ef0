"""The `fuse` pass: fused artifacts compute what the unfused ones compute (float rounding only).

For the demo model and for small random Llama, Qwen2 (non-zero QKV bias), Qwen3 (q/k norm) and
Mistral (sliding window shorter than the prompts) models, plus an INT4 (quantize_rtn, group 32,
MatMulNBits) artifact, each built by a recipe with `- name: fuse`: the fused artifact's logits are
within 1e-3 of transformers' and FUSED_TOL of the unfused artifact's (chunked prefill across blocks, as
tests/test_parity.py does), and greedy generation of 32 tokens for several prompts through
`runtime.LLM` (continuous batching, chunked prefill) gives the same tokens. The unfused artifact is
the graph the fuse pass received in that same build (`build_both`), which saves a build per model.
Fused against unfused logits are held to FUSED_TOL (1e-4): measured 1.3e-6 to 2.3e-6 on the random
models, INT4, FP8 and GQA artifacts and 1.5e-5 on the demo model (larger logits), float rounding of
the fused kernels' other summation order; a fusion that changes the math by more fails.
Fire counts, skip reasons (FP8), options, determinism and the checks are asserted too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import DEMO_MODEL, make_random_checkpoint, needs_ort, write_recipe
from test_parity import DEMO_PROMPTS, LOGITS_TOL, chunked_logits, hf_logits, hf_model, prompts_of

from compiler import streamed
from compiler.build import build
from compiler.fusion import RULES, check_model, fuse_model
from runtime import LLM, SamplingParams
from runtime.engine import LLMEngine

UNFUSED = "  - name: capture\n  - name: lower_onnx\n  - name: package\n"
FUSED = "  - name: capture\n  - name: lower_onnx\n  - name: fuse\n  - name: package\n"
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
FUSED_TOL = 1e-4  # fused vs. unfused logits (module docstring: what was measured)


def save_like_package(model: onnx.ModelProto, folder: Path) -> None:
    """Write as package writes (onnx.save_model's layout; a graph whose weights stream computes them now)."""
    for f in ("model.onnx", "model.onnx.data"):
        (folder / f).unlink(missing_ok=True)
    streamed.save_model(model, folder / "model.onnx", "model.onnx.data", size_threshold=1024)


def fused_copy(src: Path, dst: Path, rules: tuple[str, ...] | list[str] = RULES) -> dict:
    """dst = src with model.onnx fused as the pass fuses it (same function, same checks, same save)."""
    shutil.copytree(src, dst)
    rows = json.loads((src / "runtime.json").read_text())["scheduler"]["max_model_len"]
    fused, stats = fuse_model(onnx.load(src / "model.onnx"), rules, rows)
    stats["checks"] = check_model(fused)
    save_like_package(fused, dst)
    return stats


def build_both(recipe: Path, unfused: Path) -> Path:
    """Build `recipe` (which runs the fuse pass); the graph the pass received (lower_onnx's /
    lower_quant's output) is written as a second artifact at `unfused`: the same build without
    fusion, for one build's time. Returns the fused artifact. (Open `unfused` with verify=False:
    its manifest lists the fused model's sha256.)"""
    import compiler.fusion as fusion
    import compiler.passes.fuse as fuse_pass

    seen: list[onnx.ModelProto] = []
    real = fusion.fuse_model
    graph = unfused.parent / f"{unfused.name}.graph"

    def spy(model: onnx.ModelProto, rules: list[str], rope_cache_rows: int, matmul_bf16: bool = False
            ) -> tuple[onnx.ModelProto, dict]:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        seen.append(copy)
        graph.mkdir()
        save_like_package(copy, graph)  # now: streamed weights are computed from the build's sources
        return real(model, rules, rope_cache_rows=rope_cache_rows, matmul_bf16=matmul_bf16)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuse_pass, "fuse_model", spy)  # where the fuse pass calls it
        fused = build(recipe, progress=False)
    assert len(seen) == 1
    shutil.copytree(fused, unfused)
    for f in ("model.onnx", "model.onnx.data"):
        shutil.move(graph / f, unfused / f)
    graph.rmdir()
    return fused


def fuse_stats(artifact: Path) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    rec = next(p for p in manifest["passes"] if p["name"] == "fuse")
    assert rec["status"] == "applied"
    return rec["stats"]


def greedy(artifact: Path, prompts: list[list[int]], verify: bool = True) -> list[list[int]]:
    llm = LLM(artifact, verify=verify, max_num_batched_tokens=48, max_num_seqs=8)  # chunked prefill
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def randomize_biases(folder: Path, seed: int) -> None:
    """make_random_checkpoint leaves biases at their zero init (and the exporter drops zero biases)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for k in sorted(sd):
        if k.endswith(".bias"):
            sd[k] = torch.randn(sd[k].shape, generator=gen) * 0.5
    save_file(sd, path, metadata={"format": "pt"})


# -- random models of each family ------------------------------------------------------------------

VARIANTS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "qwen3-qknorm": ("Qwen3ForCausalLM", {}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 24}),
}


@pytest.fixture(scope="module", params=[
    # random Llama is marked slow: the demo (a trained Llama) covers the architecture in the fast set
    pytest.param(v, marks=pytest.mark.slow) if v == "llama" else v for v in VARIANTS])
def random_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[str, Path, Path, Path, dict]:
    """(variant, checkpoint, unfused artifact, fused artifact, fuse stats)."""
    arch, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    ckpt = make_random_checkpoint(folder / "ckpt", arch, seed=11 + list(VARIANTS).index(request.param), **overrides)
    if request.param == "qwen2-bias":
        randomize_biases(ckpt, seed=3)
    fused = build_both(write_recipe(folder, ckpt, name=request.param, passes=FUSED), folder / "unfused")
    return request.param, ckpt, folder / "unfused", fused, fuse_stats(fused)


def test_random_model_fusion_counts(random_pair: tuple[str, Path, Path, Path, dict]) -> None:
    variant, _ckpt, _unfused, _fused, stats = random_pair
    layers = 2
    norms = 2 * layers + 1 + (2 * layers if variant == "qwen3-qknorm" else 0)  # + q_norm/k_norm per layer
    assert stats["fusions"] == {"rms_norm": norms, "skip_rms_norm": 2 * layers - 1, "qkv": layers,
                                "gate_up": layers, "rotary": 2 * layers, "rotary_attention": 0,
                                "quick_gelu": layers, "swiglu": 0, "quantize_rows": 0, "row_scale": 0,
                                "skip_norm_quantize": 0}
    # rotary_attention and swiglu: graphs that use the C library (paged_cpu) only (test_paged_cpu_build)
    assert "not_fused" not in stats
    ops = stats["op_types"]
    assert ops["com.microsoft.RotaryEmbedding"] == 2 * layers
    assert "Sigmoid" not in ops and "Cos" not in ops and "Pow" not in ops and "Neg" not in ops
    assert ops["Gemm"] == 4 * layers + 1  # per layer: fused qkv, fused gate_up, o_proj, down_proj; lm_head
    assert stats["nodes_after"] < stats["nodes_before"]
    if variant == "qwen2-bias":
        model = onnx.load(_fused / "model.onnx", load_external_data=False)
        qkv = [n for n in model.graph.node if n.op_type == "Gemm" and "qkv_proj" in n.input[1]]
        assert len(qkv) == layers and all(len(n.input) == 3 and n.input[2] for n in qkv)  # bias concatenated


def test_random_model_logits(random_pair: tuple[str, Path, Path, Path, dict]) -> None:
    _variant, ckpt, unfused, fused, _stats = random_pair
    ids = prompts_of([70], seed=1)[0]
    ref = hf_logits(hf_model(ckpt), ids)
    cuts = [13, 40, 41, 70]  # chunks cross block boundaries (16) and the sliding window (24)
    got = chunked_logits(LLMEngine(fused), ids, cuts)
    base = chunked_logits(LLMEngine(unfused, verify=False), ids, cuts)
    assert np.abs(got - ref).max() < LOGITS_TOL
    assert np.abs(got - base).max() < FUSED_TOL


def test_random_model_greedy(random_pair: tuple[str, Path, Path, Path, dict]) -> None:
    _variant, _ckpt, unfused, fused, _stats = random_pair
    prompts = prompts_of([5, 17, 33, 64, 100], seed=3)  # longer than the window and one prefill chunk
    assert greedy(fused, prompts) == greedy(unfused, prompts, verify=False)


# -- INT4 (MatMulNBits) ----------------------------------------------------------------------------


def test_int4_fused_matches_unfused(tmp_path: Path) -> None:
    """MatMulNBits computing in float32 (accuracy_level 1): with int8 activations (level 4, the CPU default)
    ONNX Runtime rounds each block of a Linear's input to int8, so the last-bit difference of a fused
    normalisation (SkipSimplifiedLayerNormalization's summation order) can move a code by one and the logits
    by ~6e-3 on a CPU with VNNI: the fusion would not be what is measured."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=21)
    passes = ("  - name: capture\n  - name: quantize_rtn\n    options: {group_size: 32, ignore: [lm_head]}\n"
              "  - name: lower_onnx\n  - name: lower_quant\n    options: {accuracy_level: 1}\n"
              "  - name: fuse\n  - name: package\n")
    fused = build_both(write_recipe(tmp_path, ckpt, name="int4", passes=passes), tmp_path / "unfused")
    unfused = tmp_path / "unfused"
    stats = fuse_stats(fused)
    assert stats["fusions"]["qkv"] == 2 and stats["fusions"]["gate_up"] == 2
    assert stats["op_types"]["com.microsoft.MatMulNBits"] == 2 * 2 + 2 * 2  # fused qkv, gate_up + o, down
    model = onnx.load(fused / "model.onnx", load_external_data=False)
    qkv = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and "qkv_proj" in n.name)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in qkv.attribute}["N"] == 64 + 32 + 32
    ids = prompts_of([70], seed=1)[0]
    cuts = [13, 40, 41, 70]
    got = chunked_logits(LLMEngine(fused), ids, cuts)
    base = chunked_logits(LLMEngine(unfused, verify=False), ids, cuts)
    assert np.abs(got - base).max() < FUSED_TOL
    prompts = prompts_of([5, 33, 64], seed=4)
    assert greedy(fused, prompts) == greedy(unfused, prompts, verify=False)


def build_int8_pair(tmp_path: Path, ckpt: Path, rules: list[str]) -> Path:
    """W8A8 (per-token activations, lm_head float) with the paged_cpu kernel, fused with `rules` only; the
    unfused graph beside it at tmp_path / "unfused" (build_both)."""
    passes = ("  - name: select_attention\n    options: {kernel: paged_cpu}\n  - name: capture\n"
              "  - name: quantize_int8\n    options: {activations: per_token, ignore: [lm_head]}\n"
              f"  - name: lower_onnx\n  - name: lower_quant\n  - name: fuse\n    options: {{rules: [{', '.join(rules)}]}}\n"
              "  - name: package\n")
    return build_both(write_recipe(tmp_path, ckpt, name="int8", passes=passes), tmp_path / "unfused")


def test_int8_projections_fuse_exactly(tmp_path: Path) -> None:
    """W8A8 (MatMulIntegerToFloat, per-token activations) with q/k/v biases: the fused projections compute
    the same integer dot products and scale them by the same numbers, so logits agree to float rounding."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Qwen2ForCausalLM", seed=23)
    randomize_biases(ckpt, seed=5)
    fused = build_int8_pair(tmp_path, ckpt, ["qkv", "gate_up"])
    stats = fuse_stats(fused)
    assert stats["fusions"]["qkv"] == 2 and stats["fusions"]["gate_up"] == 2
    assert stats["op_types"]["com.microsoft.MatMulIntegerToFloat"] == 2 * 2 + 2 * 2  # fused qkv, gate_up + o, down
    model = onnx.load(fused / "model.onnx", load_external_data=False)
    split = next(n for n in model.graph.node if n.op_type == "Split" and "qkv_proj" in n.name)
    bias = next(n for n in model.graph.node if n.output[0] == split.input[0])
    assert bias.op_type == "Add"  # the three biases, concatenated, after the one row-scale Mul
    ids = prompts_of([70], seed=1)[0]
    cuts = [13, 40, 41, 70]
    got = chunked_logits(LLMEngine(fused), ids, cuts)
    base = chunked_logits(LLMEngine(tmp_path / "unfused", verify=False), ids, cuts)
    assert np.abs(got - base).max() < 1e-5
    prompts = prompts_of([5, 33, 64], seed=4)
    assert greedy(fused, prompts) == greedy(tmp_path / "unfused", prompts, verify=False)


def test_int8_row_quantization_as_one_node_is_exact(tmp_path: Path) -> None:
    """optimize.QuantizeRows computes the codes and scales of the six nodes it replaces with the same float
    operations: the logits are identical, not merely close."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=25)
    fused = build_int8_pair(tmp_path, ckpt, ["quantize_rows"])
    stats = fuse_stats(fused)
    assert stats["fusions"]["quantize_rows"] == 2 * 4  # per layer: the q/k/v input, o_proj's, gate/up's, down's
    assert stats["op_types"]["optimize.QuantizeRows"] == 8
    assert not {"Abs", "ReduceMax", "QuantizeLinear", "Div"} & set(stats["op_types"])
    ids = prompts_of([70], seed=1)[0]
    cuts = [13, 40, 41, 70]
    got = chunked_logits(LLMEngine(fused), ids, cuts)
    base = chunked_logits(LLMEngine(tmp_path / "unfused", verify=False), ids, cuts)
    np.testing.assert_array_equal(got, base)


TWIN_STEP = (prompts_of([70], seed=1)[0], [13, 40, 41, 70])  # a 70-token prompt, prefilled in four chunks


def assert_logits_equal_to_twin(fused: Path, model: onnx.ModelProto, twin: Path) -> np.ndarray:
    """Save `model` (the fused graph with the replaced nodes put back) into `twin` (a copy of the fused
    artifact) and check that both give the same logits bit for bit, chunked prefill included; returns them."""
    onnx.save(model, twin / "model.onnx")
    got = chunked_logits(LLMEngine(fused), *TWIN_STEP)
    np.testing.assert_array_equal(got, chunked_logits(LLMEngine(twin, verify=False), *TWIN_STEP))
    return got


def test_int8_row_scale_folded_into_silu_mul_is_exact(tmp_path: Path) -> None:
    """SiluMul(x, s) multiplies each row by its scale with the same float32 products as the Mul it replaces:
    the logits equal, bit for bit, those of the same graph with the Mul put back before each SiluMul."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=27)
    fused = build_int8_pair(tmp_path, ckpt, ["gate_up", "quick_gelu", "swiglu", "quantize_rows", "row_scale"])
    stats = fuse_stats(fused)
    assert stats["fusions"]["swiglu"] == 2 and stats["fusions"]["row_scale"] == 2  # each layer's gate/up
    model = onnx.load(fused / "model.onnx", load_external_data=False)
    scaled = [n for n in model.graph.node if n.op_type == "SiluMul"]
    assert len(scaled) == 2 and all(len(n.input) == 2 for n in scaled)
    producers = {o: n for n in model.graph.node for o in n.output}
    assert all(producers[n.input[1]].op_type == "QuantizeRows" for n in scaled)
    twin = tmp_path / "twin"
    shutil.copytree(fused, twin)
    for n in scaled:  # SiluMul(x, s) -> SiluMul(Mul(x, s))
        x, s = n.input
        mul = onnx.helper.make_node("Mul", [x, s], [f"{n.name}_scaled_input"], name=f"{n.name}_scale")
        model.graph.node.insert(list(model.graph.node).index(n), mul)
        del n.input[:]
        n.input.append(mul.output[0])
    got = assert_logits_equal_to_twin(fused, model, twin)
    unfused = chunked_logits(LLMEngine(tmp_path / "unfused", verify=False), *TWIN_STEP)
    assert np.abs(got - unfused).max() < 1e-4  # SiluMul's exp against MLAS's logistic: float rounding only


def test_int8_skip_norm_quantize_is_exact(tmp_path: Path) -> None:
    """optimize.SkipNormQuantize replaces o_proj's and down_proj's row-scale Mul, the residual
    SkipSimplifiedLayerNormalization and the next QuantizeRows with the same float operations: the logits
    equal, bit for bit, those of the same graph with the three nodes put back (random norms, so gamma is
    not all ones)."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=29)
    fused = build_int8_pair(tmp_path, ckpt, ["rms_norm", "skip_rms_norm", "qkv", "gate_up", "quick_gelu", "swiglu",
                                             "quantize_rows", "row_scale", "skip_norm_quantize"])
    stats = fuse_stats(fused)
    # per layer: after o_proj (the input norm of the MLP) and after down_proj (the next layer's input norm);
    # the last layer's down_proj feeds the final norm (a plain Add + norm: it reads the logits rows only) and
    # the float lm_head, which quantizes nothing
    assert stats["fusions"]["skip_norm_quantize"] == 2 * 2 - 1
    assert stats["op_types"]["optimize.SkipNormQuantize"] == 3
    assert "com.microsoft.SkipSimplifiedLayerNormalization" not in stats["op_types"]
    model = onnx.load(fused / "model.onnx", load_external_data=False)
    fusedn = [n for n in model.graph.node if n.op_type == "SkipNormQuantize"]
    assert all(len(n.input) == 4 for n in fusedn)
    twin = tmp_path / "twin"
    shutil.copytree(fused, twin)
    h = onnx.helper
    for n in fusedn:  # SkipNormQuantize(x, skip, gamma, s) -> Mul, SkipSimplifiedLayerNormalization, QuantizeRows
        x, skip, gamma, s = n.input
        codes, scale, total = n.output
        eps = next(a.f for a in n.attribute if a.name == "epsilon")
        at = list(model.graph.node).index(n)
        model.graph.node.remove(n)
        for k, node in enumerate([
                h.make_node("Mul", [x, s], [f"{n.name}_xs"], name=f"{n.name}_mul"),
                h.make_node("SkipSimplifiedLayerNormalization", [f"{n.name}_xs", skip, gamma],
                            [f"{n.name}_norm", "", "", total], name=f"{n.name}_skip", domain="com.microsoft",
                            epsilon=eps),
                h.make_node("QuantizeRows", [f"{n.name}_norm"], [codes, scale], name=f"{n.name}_rows",
                            domain="optimize")]):
            model.graph.node.insert(at + k, node)
    assert_logits_equal_to_twin(fused, model, twin)
    prompts = prompts_of([5, 33, 64], seed=4)
    assert greedy(fused, prompts) == greedy(tmp_path / "unfused", prompts, verify=False)


# -- the demo model, through the build -------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(unfused, fused) demo artifacts; the fused one built by a recipe with the fuse pass."""
    folder = tmp_path_factory.mktemp("demo-fusion")
    runtime = ("  kv_block_size: 16\n  num_kv_blocks: 512\n  max_num_seqs: 16\n  max_num_batched_tokens: 512\n"
               "  max_model_len: 1024\n")  # as recipes/demo.yaml
    fused = build_both(write_recipe(folder, DEMO_MODEL, name="demo-fused", passes=FUSED, runtime=runtime),
                       folder / "unfused")
    return folder / "unfused", fused


def test_demo_fusion_stats_in_manifest(demo_pair: tuple[Path, Path]) -> None:
    _unfused, fused = demo_pair
    stats = fuse_stats(fused)
    # 6 layers: 13 RMSNorms (2 per layer + final), 11 of them after a residual Add (all but layer 0's
    # input norm and the final norm, which reads the logits rows), q and k rotated in each layer.
    assert stats["fusions"] == {"rms_norm": 13, "skip_rms_norm": 11, "qkv": 6, "gate_up": 6, "rotary": 12,
                                "rotary_attention": 0, "quick_gelu": 6, "swiglu": 0, "quantize_rows": 0,
                                "row_scale": 0, "skip_norm_quantize": 0}
    assert stats["rules"] == list(RULES) and stats["disabled"] == []
    assert stats["nodes_before"] > stats["nodes_after"]
    assert stats["op_types"]["SimplifiedLayerNormalization"] == 2
    assert stats["op_types"]["com.microsoft.SkipSimplifiedLayerNormalization"] == 11
    assert stats["rotary_cache_rows"] == 1024
    assert stats["checks"]["onnxruntime_session"]
    model = onnx.load(fused / "model.onnx", load_external_data=False)
    cache = next(t for t in model.graph.initializer if t.name == "rotary_cos_cache")
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    assert list(cache.dims) == [1024, cfg["hidden_size"] // cfg["num_attention_heads"] // 2]  # rows, head_dim / 2


def test_demo_fused_logits_and_greedy(demo_pair: tuple[Path, Path]) -> None:
    unfused, fused = demo_pair
    engine = LLMEngine(fused)
    ids = engine.tokenizer.encode(DEMO_PROMPTS[7])
    ref = hf_logits(hf_model(DEMO_MODEL), ids)
    got = chunked_logits(engine, ids, [9, 16, 17, 33, len(ids)])
    base = chunked_logits(LLMEngine(unfused, verify=False), ids, [9, 16, 17, 33, len(ids)])
    assert np.abs(got - ref).max() < LOGITS_TOL
    assert np.abs(got - base).max() < FUSED_TOL
    prompts = [engine.tokenizer.encode(p) for p in DEMO_PROMPTS]
    assert greedy(fused, prompts) == greedy(unfused, prompts, verify=False)


def test_demo_fusion_is_deterministic_and_matches_the_build(demo_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """fuse_model twice on the unfused graph -> the same bytes, equal to the built fused model.onnx."""
    unfused, fused = demo_pair
    fused_copy(unfused, tmp_path / "a")
    fused_copy(unfused, tmp_path / "b")
    for f in ("model.onnx", "model.onnx.data"):
        a = (tmp_path / "a" / f).read_bytes()
        assert a == (tmp_path / "b" / f).read_bytes()
        assert a == (fused / f).read_bytes()


def test_rules_can_be_turned_off(demo_pair: tuple[Path, Path]) -> None:
    unfused, _fused = demo_pair
    model = onnx.load(unfused / "model.onnx")
    out, stats = fuse_model(model, [r for r in RULES if r not in ("rotary", "skip_rms_norm")], 1024)
    assert stats["fusions"]["rotary"] == 0 and stats["fusions"]["skip_rms_norm"] == 0
    assert stats["disabled"] == ["skip_rms_norm", "rotary"]
    assert stats["fusions"]["rms_norm"] == 13 and stats["fusions"]["qkv"] == 6
    ops = {n.op_type for n in out.graph.node}
    assert "RotaryEmbedding" not in ops and "SkipSimplifiedLayerNormalization" not in ops and "Cos" in ops
    check_model(out, onnxruntime_session=False)
    none, stats = fuse_model(onnx.load(unfused / "model.onnx"), [], 1024)
    assert set(stats["fusions"].values()) == {0} and stats["nodes_after"] <= stats["nodes_before"]


def test_fuse_options_in_recipe(tmp_path: Path) -> None:
    from compiler.build import plan
    from compiler.passes.fuse import FuseOptions
    from compiler.recipe import RecipeError

    assert FuseOptions(disable=["rotary"]).enabled() == ["rms_norm", "skip_rms_norm", "qkv", "gate_up", "rotary_attention",
                                                      "quick_gelu", "swiglu", "quantize_rows", "row_scale",
                                                      "skip_norm_quantize"]
    assert FuseOptions(rules=["qkv", "rotary"]).enabled() == ["qkv", "rotary"]
    ok = write_recipe(tmp_path, DEMO_MODEL, name="ok", passes=(
        "  - name: capture\n  - name: lower_onnx\n  - name: fuse\n    options: {disable: [rotary]}\n"
        "  - name: package\n"))
    assert plan(ok).passes[2].config.enabled()[-1] == "skip_norm_quantize"
    bad = write_recipe(tmp_path, DEMO_MODEL, name="bad", passes=(
        "  - name: capture\n  - name: lower_onnx\n  - name: fuse\n    options: {rules: [qkv, geglu]}\n"
        "  - name: package\n"))
    with pytest.raises(RecipeError, match="geglu"):
        plan(bad)
    early = write_recipe(tmp_path, DEMO_MODEL, name="early", passes="  - name: capture\n  - name: fuse\n  - name: package\n")
    with pytest.raises(RecipeError, match="lower_onnx"):
        plan(early)


@needs_ort("fp8_activations")
@pytest.mark.slow
def test_fp8_projections_are_left_alone_with_a_reason(tmp_path: Path) -> None:
    """FP8 weights are DequantizeLinear outputs: qkv / gate_up record why they did not fuse; the other
    rules still apply and the numbers do not move."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=31)
    passes = ("  - name: capture\n  - name: quantize_fp8\n    options: {activations: dynamic}\n"
              "  - name: lower_onnx\n  - name: lower_quant\n  - name: fuse\n  - name: package\n")
    fused = build_both(write_recipe(tmp_path, ckpt, name="fp8", passes=passes), tmp_path / "unfused")
    stats = fuse_stats(fused)
    assert stats["fusions"]["qkv"] == 0 and stats["fusions"]["gate_up"] == 0
    assert stats["fusions"]["rotary"] == 4 and stats["fusions"]["skip_rms_norm"] == 3
    for rule in ("qkv", "gate_up"):
        reasons = stats["not_fused"][rule]
        assert len(reasons) == 2 and all("DequantizeLinear" in why for why in reasons.values()), reasons
    ids = prompts_of([70], seed=1)[0]
    cuts = [13, 40, 41, 70]
    got = chunked_logits(LLMEngine(fused), ids, cuts)
    base = chunked_logits(LLMEngine(tmp_path / "unfused", verify=False), ids, cuts)
    assert np.abs(got - base).max() < FUSED_TOL


@needs_ort("gqa")
@pytest.mark.slow
def test_fusion_with_a_forced_attention_variant(tmp_path: Path) -> None:
    """select_attention kernel gqa (com.microsoft.GroupQueryAttention) + fuse: a build failure fails."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM", seed=41)
    passes = "  - name: select_attention\n    options: {kernel: gqa}\n" + FUSED
    fused = build_both(write_recipe(tmp_path, ckpt, name="gqa", passes=passes), tmp_path / "unfused")
    assert fuse_stats(fused)["fusions"]["qkv"] == 2
    ids = prompts_of([70], seed=1)[0]
    cuts = [13, 40, 41, 70]
    got = chunked_logits(LLMEngine(fused), ids, cuts)
    assert np.abs(got - hf_logits(hf_model(ckpt), ids)).max() < LOGITS_TOL
    assert np.abs(got - chunked_logits(LLMEngine(tmp_path / "unfused", verify=False), ids, cuts)).max() < FUSED_TOL
    prompts = prompts_of([5, 33, 64], seed=4)
    assert greedy(fused, prompts) == greedy(tmp_path / "unfused", prompts, verify=False)

