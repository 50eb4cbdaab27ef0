"""Attention-variant selection (select_attention) and the fused variants (compiler/attention/).

- GroupQueryAttention (gqa) against the decomposed path on one mixed batch (prefill chunks with and
  without past, decode tokens, blocks out of order) for GQA 4/2, MHA, MQA, a sliding window shorter
  than the past and Qwen3's q/k norm: logits and new K/V within 1e-3, and the eager reference too;
- gqa-built artifacts against transformers (Mistral with a sliding window, Qwen3): chunked logits
  within 1e-3 and 32 greedy tokens through the runtime with staggered prompts;
- the pass: candidates and stats on the demo (rule), forced kernels, autotune timings in build.json,
  byte-reproducible builds with autotune off;
- the PagedAttention form of the demo validated against ONNX Runtime's registered schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEMO_MODEL, DEMO_RECIPE, make_random_checkpoint, needs_ort, write_recipe

from compiler.attention import attention_kind, candidates
from compiler.build import build, plan
from compiler.checkpoint import inspect_checkpoint, load_weights
from compiler.passes.base import BuildContext, BuildError
from compiler.passes.select_attention import SelectAttentionOptions, SelectAttentionPass

TOL = 1e-3
SELECT = "  - name: select_attention\n    options: {opts}\n  - name: capture\n  - name: lower_onnx\n  - name: package\n"


# -- candidates and the pass on the demo (no build) --------------------------------------------------


@needs_ort("gqa")
def test_candidates_by_target() -> None:
    cfg = inspect_checkpoint(DEMO_MODEL).config
    cpu = {c.variant: c for c in candidates(cfg, "onnxruntime", "cpu", "float32")}
    assert cpu["decomposed"].valid and cpu["gqa"].valid and cpu["paged_cpu"].valid
    assert not cpu["paged_attention"].valid and "CUDA only" in cpu["paged_attention"].reason
    cuda = {c.variant: c for c in candidates(cfg, "onnxruntime", "cuda", "float16")}
    assert cuda["paged_attention"].valid and not cuda["gqa"].valid and "in-place cache write" in cuda["gqa"].reason
    assert not {c.variant: c for c in candidates(cfg, "onnxruntime", "cuda", "float32")}["paged_attention"].valid
    quant = {c.variant: c for c in candidates(cfg, "onnxruntime", "cpu", "float32", ["quantize_kv_cache"])}
    assert quant["gqa"].valid and "quantize_kv_cache" in quant["gqa"].reason
    assert not quant["paged_attention"].valid
    assert quant["paged_cpu"].valid and "int8 pools" in quant["paged_cpu"].reason  # int8 unless told otherwise
    fp8 = {c.variant: c for c in candidates(cfg, "onnxruntime", "cpu", "float32", ["quantize_kv_cache"], "fp8")}
    assert not fp8["paged_cpu"].valid and "FP8 pools" in fp8["paged_cpu"].reason
    assert not cuda["paged_cpu"].valid and "CPU execution provider only" in cuda["paged_cpu"].reason
    torch_target = {c.variant: c.valid for c in candidates(cfg, "torch", "cpu", "float32")}
    assert torch_target == {"decomposed": True, "gqa": False, "paged_cpu": False, "paged_attention": False,
                            "triton": False, "flashinfer": False}
    torch_cuda = {c.variant: c for c in candidates(cfg, "torch", "cuda", "float16")}
    assert torch_cuda["triton"].valid and torch_cuda["decomposed"].valid
    assert "torch targets only" in cpu["triton"].reason and not cuda["triton"].valid
    kind = attention_kind(cfg)
    assert (kind["heads"], kind["num_heads"], kind["num_kv_heads"], kind["sliding_window"]) == ("GQA", 8, 2, None)


@needs_ort("gqa")
def test_gqa_is_refused_where_onnx_runtime_has_no_query_seqlens(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ONNX Runtime before 1.32 registers GroupQueryAttention without query_seqlens: the variant is invalid
    with that reason (not an exporter error deep in lower_onnx); the schema is this ONNX Runtime's, less it."""
    from types import SimpleNamespace

    from compiler.attention import schema

    real = schema.ort_schema("GroupQueryAttention")
    assert "query_seqlens" in [p.name for p in real.inputs]
    older = SimpleNamespace(inputs=[p for p in real.inputs if p.name != "query_seqlens"])
    monkeypatch.setattr(schema, "ort_schema", lambda name, domain=schema.DOMAIN: older)
    cfg = inspect_checkpoint(DEMO_MODEL).config
    gqa = {c.variant: c for c in candidates(cfg, "onnxruntime", "cpu", "float32")}["gqa"]
    assert not gqa.valid
    assert "has no input 'query_seqlens'" in gqa.reason and "onnxruntime >= 1.32" in gqa.reason


def test_paged_attention_is_refused_where_onnx_runtime_registers_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime 1.20 registers no com.microsoft.PagedAttention: the variant is invalid with that reason, and
    nothing else needs the schema (the lowering looks it up only when it lowers to the op)."""
    from compiler.attention import schema

    real = schema.ort_schema

    def without_paged(name: str, domain: str = schema.DOMAIN) -> object:
        if name == "PagedAttention":
            raise LookupError(f"ONNX Runtime registers no schema {domain}.{name}")
        return real(name, domain)

    monkeypatch.setattr(schema, "ort_schema", without_paged)
    cfg = inspect_checkpoint(DEMO_MODEL).config
    cuda = {c.variant: c for c in candidates(cfg, "onnxruntime", "cuda", "float16")}
    assert not cuda["paged_attention"].valid
    assert cuda["paged_attention"].reason == "ONNX Runtime registers no schema com.microsoft.PagedAttention"
    assert {c.variant: c for c in candidates(cfg, "onnxruntime", "cpu", "float32")}["paged_cpu"].valid


def _demo_ctx(tmp_path: Path) -> BuildContext:
    p = plan(DEMO_RECIPE)
    return BuildContext(recipe=p.recipe, checkpoint=p.checkpoint, staging=tmp_path)


@needs_ort("gqa")
def test_demo_stats_rule(tmp_path: Path) -> None:
    ctx = _demo_ctx(tmp_path)
    stats = SelectAttentionPass(SelectAttentionOptions(autotune=False)).run(ctx)
    assert stats["choice"] == "paged_cpu" and stats["reason"] == "rule" and stats["autotune"] is False
    assert stats["attention_kind"]["heads"] == "GQA"
    assert [c["variant"] for c in stats["candidates"]] == ["decomposed", "gqa", "paged_cpu", "paged_attention",
                                                           "triton", "flashinfer"]
    assert [c["valid"] for c in stats["candidates"]] == [True, True, True, False, False, False]
    assert ctx.artifacts["attention"]["variant"] == "paged_cpu"
    json.dumps(stats, sort_keys=True)  # manifest-ready
    # the build driver's --no-autotune flag wins over the recipe's autotune: true
    ctx = _demo_ctx(tmp_path)
    ctx.artifacts["no_autotune"] = True
    stats = SelectAttentionPass(SelectAttentionOptions()).run(ctx)
    assert stats["reason"] == "rule" and "attention_autotune" not in ctx.build_info


@needs_ort("gqa")
def test_forced_kernels(tmp_path: Path) -> None:
    ctx = _demo_ctx(tmp_path)
    stats = SelectAttentionPass(SelectAttentionOptions(kernel="gqa")).run(ctx)
    assert (stats["choice"], stats["reason"]) == ("gqa", "forced")
    assert ctx.artifacts["attention_kernel"]["implementation"] == "com.microsoft.GroupQueryAttention"
    with pytest.raises(BuildError, match="CUDA only"):
        SelectAttentionPass(SelectAttentionOptions(kernel="paged_attention")).run(_demo_ctx(tmp_path))
    ctx = _demo_ctx(tmp_path)
    ctx.completed.append("capture")
    with pytest.raises(BuildError, match="before capture"):
        SelectAttentionPass(SelectAttentionOptions()).run(ctx)


# -- gqa numerics against the decomposed path (ONNX, one mixed batch) --------------------------------

GRAPH_CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-mha": ("LlamaForCausalLM", {"num_key_value_heads": 4}),
    "llama-mqa": ("LlamaForCausalLM", {"num_key_value_heads": 1}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 24}),
    "qwen3-qknorm": ("Qwen3ForCausalLM", {"layer_types": ["full_attention"]}),
}
SLOW_GRAPH_CASES = {"llama-mha", "llama-mqa", "qwen3-qknorm"}  # ~15 s each (two exports)


def _onnx_session(proto):  # noqa: ANN001, ANN202
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_GRAPH_CASES else [])
                                  for c in GRAPH_CASES], ids=list(GRAPH_CASES))
@needs_ort("gqa")
def test_gqa_graph_matches_decomposed(case: str, tmp_path: Path) -> None:
    from compiler.attention.autotune import _mixed_batch
    from compiler.export import export_forward_batch, graph_io_names, lower_exported
    from compiler.models.llama import LlamaForwardBatchModel

    arch, over = GRAPH_CASES[case]
    ckpt = make_random_checkpoint(tmp_path / "ckpt", arch, seed=5, num_hidden_layers=1, **over)
    info = inspect_checkpoint(ckpt)
    cfg = info.config
    weights = load_weights(info)
    bs = 16
    fb = _mixed_batch(bs, cfg.vocab_size, np.random.default_rng(3))  # pasts 0/37/70/5/16, chunks 20/13/1/1/16
    rng = np.random.default_rng(4)
    pools = [rng.standard_normal((64, bs, cfg.num_kv_heads, cfg.head_dim), dtype=np.float32) for _ in range(2)]
    past_blocks = -(-int(fb.past_lens.max()) // bs)
    feeds = dict(zip(graph_io_names(1)[0], [fb.input_ids, fb.positions, fb.cu_seqlens, fb.past_lens,
                                           np.ascontiguousarray(fb.block_table[:, :past_blocks]), fb.logits_index,
                                           *pools], strict=True))
    outs, eager = {}, {}
    for variant in ("decomposed", "gqa"):
        model = LlamaForwardBatchModel(cfg, bs, attention=variant)
        model.load_hf_state_dict(weights, torch.float32)
        model.eval()
        proto = lower_exported(export_forward_batch(model, cfg, bs, torch.float32)[0], 1, attention=variant)
        ops = {n.op_type for n in proto.graph.node}
        assert ("GroupQueryAttention" in ops) == (variant == "gqa")
        outs[variant] = _onnx_session(proto).run(None, feeds)
        with torch.no_grad():
            eager[variant] = model(*[torch.from_numpy(np.asarray(x)) for x in feeds.values()])[0].numpy()
    for got, want in zip(outs["gqa"], outs["decomposed"], strict=True):
        assert np.abs(got - want).max() < TOL
    assert np.abs(eager["gqa"] - outs["decomposed"][0]).max() < TOL  # the custom op's reference
    assert np.abs(eager["decomposed"] - outs["decomposed"][0]).max() < TOL


# -- gqa artifacts against transformers -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch,over", [("LlamaForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 24}),
                                      ("Qwen3ForCausalLM", {})], ids=["llama", "mistral-sliding", "qwen3"])
@needs_ort("gqa")
def test_gqa_artifact_matches_transformers(arch: str, over: dict, tmp_path: Path) -> None:
    import onnx
    from test_parity import chunked_logits, hf_greedy, hf_logits, hf_model, prompts_of, staggered_greedy

    from runtime.engine import LLMEngine

    ckpt = make_random_checkpoint(tmp_path / "ckpt", arch, seed=7, **over)
    recipe = write_recipe(tmp_path, ckpt, name=arch.lower(), passes=SELECT.format(opts="{kernel: gqa}"))
    artifact = build(recipe, progress=False)
    manifest = json.loads((artifact / "manifest.json").read_text())
    stats = next(p for p in manifest["passes"] if p["name"] == "select_attention")["stats"]
    assert (stats["choice"], stats["reason"]) == ("gqa", "forced")
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "GroupQueryAttention" for n in graph.graph.node) == 2
    hf = hf_model(ckpt)
    ids = prompts_of([70], seed=1)[0]
    got = chunked_logits(LLMEngine(artifact), ids, [13, 40, 41, 70])
    assert np.abs(got - hf_logits(hf, ids)).max() < TOL
    prompts = prompts_of([5, 17, 33, 64, 100, 15, 48, 81], seed=3)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    engine = LLMEngine(artifact, max_num_batched_tokens=48, max_num_seqs=8)
    assert staggered_greedy(engine, prompts, arrivals=[0, 0, 1, 3, 4, 9, 15, 22], n=32) == want


# -- autotune and reproducibility -------------------------------------------------------------------

SMALL_RUNTIME = ("  kv_block_size: 16\n  num_kv_blocks: 128\n  max_num_seqs: 8\n"
                 "  max_num_batched_tokens: 256\n  max_model_len: 256\n")


@needs_ort("gqa")
@pytest.mark.slow
def test_autotune_records_timings(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=1, num_hidden_layers=1)
    recipe = write_recipe(tmp_path, ckpt, name="tuned", passes=SELECT.format(opts="{}"), runtime=SMALL_RUNTIME)
    artifact = build(recipe, progress=False)
    manifest = json.loads((artifact / "manifest.json").read_text())
    stats = next(p for p in manifest["passes"] if p["name"] == "select_attention")["stats"]
    assert stats["reason"] == "autotune" and stats["choice"] in ("decomposed", "gqa", "paged_cpu")
    assert "ms" not in json.dumps(stats)  # no timings in the manifest
    info = json.loads((artifact / "build.json").read_text())
    tune = info["attention_autotune"]
    assert set(tune["results"]) == {"decomposed", "gqa", "paged_cpu"}
    for r in tune["results"].values():
        assert r["valid"] and set(r["median_ms"]) == {s["name"] for s in tune["shapes"]}
        assert all(t > 0 for t in r["median_ms"].values())
    assert tune["fastest"] == stats["choice"]
    # the CPU code path the candidates ran on, for the runtime's warning on another CPU
    from cpu_paths import expected_default

    assert stats["measured_on"]["isa"] == expected_default() == tune["cpu_paths"]["isa"]
    assert stats["measured_on"]["ops"]["PagedAttention"] == expected_default()


@pytest.mark.slow
def test_autotune_off_is_reproducible(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=2, num_hidden_layers=1)
    recipe = write_recipe(tmp_path, ckpt, name="fixed", passes=SELECT.format(opts="{autotune: false}"),
                          runtime=SMALL_RUNTIME)
    files = []
    for i in range(2):
        artifact = build(recipe, progress=False, output=tmp_path / f"out{i}")
        files.append({f: (artifact / f).read_bytes() for f in ("manifest.json", "model.onnx", "model.onnx.data")})
        assert "attention_autotune" not in json.loads((artifact / "build.json").read_text())
    assert files[0] == files[1]
    stats = next(p for p in json.loads(files[0]["manifest.json"])["passes"]
                 if p["name"] == "select_attention")["stats"]
    assert (stats["choice"], stats["reason"]) == ("paged_cpu", "rule")


# -- PagedAttention (CUDA only): built and validated against the registered schema ------------------


@needs_ort("paged_attention")
def test_schema_validation_catches_mistakes() -> None:
    from onnx import TensorProto, helper

    from compiler.attention.schema import validate_node

    ok = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "past", "bt"], ["o"],
                          domain="com.microsoft", num_heads=8, kv_num_heads=2, scale=0.5)
    f16, i32 = TensorProto.FLOAT16, TensorProto.INT32
    types = {"q": f16, "k": f16, "v": f16, "kc": f16, "vc": f16, "cu": i32, "past": i32, "bt": i32, "o": f16}
    assert validate_node(ok, types) == []
    assert any("float" in p for p in validate_node(ok, {**types, "q": TensorProto.FLOAT}))
    assert any("int64" in p for p in validate_node(ok, {**types, "bt": TensorProto.INT64}))
    missing = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "", "bt"], ["o"],
                               domain="com.microsoft", num_heads=8, kv_num_heads=2)
    assert any("past_seqlens" in p for p in validate_node(missing, types))
    bad_attr = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "past", "bt"], ["o"],
                                domain="com.microsoft", num_heads=8, kv_num_heads=2.0, colour=1)
    problems = validate_node(bad_attr, types)
    assert any("kv_num_heads" in p and "FLOAT" in p for p in problems) and any("colour" in p for p in problems)
    no_heads = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "past", "bt"], ["o"],
                                domain="com.microsoft", num_heads=8)
    assert any("kv_num_heads" in p for p in validate_node(no_heads, types))


@needs_ort("paged_attention")
@pytest.mark.slow
def test_paged_attention_demo_graph_validates() -> None:
    from compiler.attention.paged import paged_attention_model, validate_paged_attention

    model = paged_attention_model(DEMO_MODEL)
    result = validate_paged_attention(model)
    assert result["problems"] == []
    assert result["nodes"] == 6  # one per layer
    assert result["typed_inputs"] == 6 * 8  # every input's element type was known and checked
    names = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert names["key_cache.0"] == 10  # float16 pools in our layout [num_blocks, block_size, kv_heads, d]
    node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    assert list(node.input[3:8]) == ["key_cache.0", "value_cache.0", "cu_seqlens", "past_lens", "block_table"]
