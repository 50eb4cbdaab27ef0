"""The families beyond Llama's own layout through the quantization side of the build.

Calibration (compiler/quant/calibration.py LayerRunner) runs the model one decoder layer at a time; it
takes the embedding, the rotation and the layer's residual wiring from the model itself, so Granite's
multipliers, Phi-3's partial LongRoPE rotation, OLMo 2's post-norms and Gemma's sandwich norms, soft-capping
and (Gemma 3) local RoPE are calibrated on the activations
the artifact computes (checked here against the model's own forward). AWQ and SmoothQuant fold scales
into the norm before q/k/v and gate/up, which a post-norm layer does not have: they refuse it by name.
Logits and greedy tokens of each family against transformers: tests/test_parity.py; here, InternLM 3, a
family added by its declaration alone (compiler/models/families.py), from checkpoint to served tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from conftest import make_random_checkpoint, write_recipe
from test_checkpoint import eager_logits
from test_parity import LOGITS_TOL, LONGROPE, chunked_logits, hf_greedy, hf_logits, hf_model, prompts_of

from compiler.build import build
from compiler.checkpoint import CheckpointError, inspect_checkpoint, load_weights
from compiler.models.llama import LlamaForwardBatchModel
from compiler.passes.base import BuildError
from compiler.quant.calibration import LayerRunner
from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams

FAMILIES = {
    "granite": ("GraniteForCausalLM", {}),
    "phi3-longrope-partial": ("Phi3ForCausalLM", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 512,
                                                  "max_position_embeddings": 2048}),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", {}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {}),
}


@pytest.mark.parametrize("lengths", [(40, 31), (36, 36)], ids=["paged", "dense"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_calibration_runs_the_layers_the_artifact_computes(family: str, lengths: tuple[int, int],
                                                           tmp_path: Path) -> None:
    """Equal-length samples take the dense attention path where no layer has a window or soft-capping
    (Granite, Phi-3, OLMo 2), the paged one otherwise; both equal the model's forward."""
    arch, overrides = FAMILIES[family]
    ckpt = make_random_checkpoint(tmp_path / "ckpt", arch, seed=3, **overrides)
    info = inspect_checkpoint(ckpt, max_model_len=512)
    model = LlamaForwardBatchModel(info.config, 16).eval()
    model.load_hf_state_dict(load_weights(info), torch.float32)
    samples = [list(range(5, 5 + lengths[0])), list(range(100, 100 + lengths[1]))]
    runner = LayerRunner(model, samples)
    assert (runner.batches[0].seq_len is not None) == (lengths[0] == lengths[1] and family in
                                                       ("granite", "phi3-longrope-partial", "olmo2", "mixtral",
                                                        "qwen2-moe"))
    for i in range(len(model.layers)):
        runner.advance(i)
    hidden = torch.cat(runner.hidden)  # one batch: both samples packed
    # the model's forward on the same packed sequences, every token's logits
    ids = torch.tensor([t for s in samples for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in samples])
    cu = torch.tensor([0, len(samples[0]), len(ids)], dtype=torch.int32)
    pools = [torch.zeros(1, 16, info.config.num_kv_heads, info.config.head_dim) for _ in range(2 * len(model.layers))]
    with torch.no_grad():
        logits = model(ids, pos, cu, torch.zeros(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                       torch.arange(len(ids)), *pools)[0]
        from_runner = model.lm_head(model.norm(hidden)) / info.config.logits_scaling
        cap = info.config.final_logit_softcapping
        if cap:
            from_runner = torch.tanh(from_runner / cap) * cap
    torch.testing.assert_close(from_runner, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["granite", "gemma2", "mixtral"])
def test_capture_stops_the_layer_once_every_input_is_seen_and_sees_what_the_full_forward_sees(
        family: str, tmp_path: Path) -> None:
    """LayerRunner.capture stops a batch's forward at the last named module's input; the inputs equal those
    a full forward of the layer feeds, and Linears fed one tensor get one float32 tensor object."""
    arch, overrides = FAMILIES[family]
    ckpt = make_random_checkpoint(tmp_path / "ckpt", arch, seed=5, **overrides)
    info = inspect_checkpoint(ckpt, max_model_len=512)
    model = LlamaForwardBatchModel(info.config, 16).eval()
    model.load_hf_state_dict(load_weights(info), torch.float32)
    runner = LayerRunner(model, [list(range(5, 45)), list(range(100, 131))], max_tokens_per_batch=40)
    assert len(runner.hidden) == 2
    layer = model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    steps = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
             [n for n in linears if n.endswith(("gate_proj", "up_proj"))]]
    assert steps[2], list(linears)
    full: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    handles = [m.register_forward_hook(lambda _m, a, _o, n=n: full[n].append(a[0].reshape(-1, a[0].shape[-1])))
               for n, m in linears.items()]
    try:
        runner.outputs(0)
    finally:
        for h in handles:
            h.remove()
    for step in steps:
        fed: list[tuple[str, torch.Tensor]] = []
        later: list[str] = []  # the Linears after the step's that ran
        handles = [linears[n].register_forward_pre_hook(lambda _m, _a, n=n, later=later: later.append(n))
                   for n in linears if not n.startswith("self_attn") and n not in step]
        try:
            seen = runner.capture(0, {n: linears[n] for n in step}, sink=lambda n, x, fed=fed: fed.append((n, x)))
        finally:
            for h in handles:
                h.remove()
        if family != "mixtral" or not step[0].endswith(("gate_proj", "up_proj")):  # unrouted experts: runs on
            assert not later, later  # nothing of the MLP past the step's inputs was computed
        assert not any(seen.values())  # streamed to the sink
        for n in step:
            got = [x for m, x in fed if m == n]
            assert len(got) == len(full[n]), n
            for a, b in zip(got, full[n], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        if step[0].endswith("q_proj"):  # one input object for q, k and v in each batch
            assert all(fed[b][1] is fed[b + 1][1] is fed[b + 2][1] for b in range(0, len(fed), 3))


@pytest.mark.parametrize("family", ["granite", "olmo2", "gemma2", "mixtral"])
def test_kept_attention_and_mlp_input_give_the_full_forward_without_recomputing(family: str, tmp_path: Path
                                                                               ) -> None:
    """GPTQ's order: once the attention is final its output is kept from the next forward on, once gate/up are
    final down_proj's input too; the later captures and advance skip what was kept and still compute exactly
    what a fresh forward with the final weights computes. A mixture of experts keeps the attention only."""
    arch, overrides = FAMILIES[family]
    ckpt = make_random_checkpoint(tmp_path / "ckpt", arch, seed=7, **overrides)
    info = inspect_checkpoint(ckpt, max_model_len=512)
    model = LlamaForwardBatchModel(info.config, 16).eval()
    model.load_hf_state_dict(load_weights(info), torch.float32)
    samples = [list(range(5, 45)), list(range(100, 131))]
    runner = LayerRunner(model, samples, max_tokens_per_batch=40)
    layer = model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    gate_up = {n: linears[n] for n in linears if n.endswith(("gate_proj", "up_proj"))}
    down = {n: linears[n] for n in linears if n.endswith("down_proj")}
    calls: dict[str, int] = {"o_proj": 0, "gate_up": 0, "down": 0}

    def count(key: str) -> Any:
        def hook(_m: torch.nn.Module, _a: tuple[Any, ...]) -> None:
            calls[key] += 1
        return hook

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(count("o_proj"))]
    handles += [m.register_forward_pre_hook(count("gate_up")) for m in gate_up.values()]
    handles += [m.register_forward_pre_hook(count("down")) for m in down.values()]
    batches = len(runner.hidden)
    try:
        runner.attention_final(0)
        runner.capture(0, gate_up, sink=lambda _n, _x: None)
        assert calls["o_proj"] == batches  # computed once per batch and kept
        dense = runner.mlp_input_final(0)
        assert dense == (family != "mixtral")
        runner.capture(0, down, sink=lambda _n, _x: None)
        assert calls["o_proj"] == batches  # the kept output reused
        before = dict(calls)
        with torch.no_grad():  # what quantizing down_proj does to it
            for m in down.values():
                m.weight.mul_(0.5)
        runner.advance(0)
    finally:
        for h in handles:
            h.remove()
    assert calls["o_proj"] == before["o_proj"]
    if dense:
        assert calls["gate_up"] == before["gate_up"] and calls["down"] == before["down"] + batches
    else:  # the experts' MLP runs again
        assert calls["gate_up"] > before["gate_up"]
    fresh = LayerRunner(model, samples, max_tokens_per_batch=40)
    for got, want in zip(runner.hidden, fresh.outputs(0), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert runner._kept is None  # advance dropped what it kept


@pytest.mark.parametrize(("passes", "needle"), [
    ("  - name: quantize_awq\n    options: {group_size: 32}\n", "quantize_awq: Olmo2ForCausalLM normalises"),
    ("  - name: quantize_int8\n    options: {smoothquant_alpha: 0.5}\n", "quantize_int8: smoothquant_alpha folds"),
])
def test_scale_folding_methods_refuse_a_post_norm_model(passes: str, needle: str, tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Olmo2ForCausalLM", seed=4)
    calib = tmp_path / "calib.txt"
    calib.write_text("def f(x):\n    return x + 1\n" * 100, encoding="utf-8")
    recipe = write_recipe(tmp_path, ckpt, name="olmo2-q", passes=(
        f"  - name: capture\n{passes}  - name: lower_onnx\n  - name: lower_quant\n  - name: package\n"),
        extra=f"calibration:\n  data: {calib}\n  num_samples: 2\n  seq_len: 32\n")
    with pytest.raises(BuildError, match=needle):
        build(recipe, progress=False)
    assert not list((tmp_path / "artifacts").rglob("manifest.json"))  # nothing published


def test_gemma2_attention_takes_the_decomposed_path_only(tmp_path: Path) -> None:
    """Soft-capped scores: every fused variant is invalid with the reason, and forcing the kernel fails the build."""
    from compiler.attention import candidates

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Gemma2ForCausalLM", seed=6)
    cfg = inspect_checkpoint(ckpt).config
    assert cfg.sliding_windows == (24, None) and cfg.attn_logit_softcapping == 5.0
    found = {c.variant: c for c in candidates(cfg, "onnxruntime", "cpu", "float32")}
    assert found["decomposed"].valid
    assert all(not c.valid and "soft-capping" in c.reason for v, c in found.items() if v != "decomposed")
    recipe = write_recipe(tmp_path, ckpt, name="gemma2-kernel", passes=(
        "  - name: select_attention\n    options: {kernel: paged_cpu}\n  - name: capture\n  - name: lower_onnx\n"
        "  - name: package\n"))
    with pytest.raises(Exception, match="soft-capping"):
        build(recipe, progress=False)


def test_internlm3_is_built_from_its_declaration_alone(tmp_path: Path) -> None:
    """InternLM 3 is one declaration in compiler/models/families.py and nothing else: transformers builds
    model_type internlm3 with LlamaForCausalLM, reading the biases from config.json's `qkv_bias` (q/k/v/o) and
    `bias` (the MLP), the names internlm/internlm3-8b-instruct's config uses. Random weights, norms and biases
    included: the eager model within the Llama test's 1e-4 (tests/test_checkpoint.py), the built artifact's
    chunked logits within LOGITS_TOL and its greedy tokens equal to transformers'."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "InternLM3ForCausalLM", seed=11, attention_bias=True,
                                  mlp_bias=True)
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["InternLM3ForCausalLM"], "internlm3")
    cfg["qkv_bias"], cfg["bias"] = cfg.pop("attention_bias"), cfg.pop("mlp_bias")
    path.write_text(json.dumps(cfg))
    hf = hf_model(ckpt)
    assert type(hf) is transformers.LlamaForCausalLM and hf.model.layers[0].self_attn.o_proj.bias is not None
    config = inspect_checkpoint(ckpt).config
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, True, True)
    ids = prompts_of([70], seed=1)[0]
    want = hf_logits(hf, ids)
    eager = eager_logits(ckpt, ids).numpy()
    assert np.abs(eager - want).max() < 1e-4
    artifact = build(write_recipe(tmp_path, ckpt, name="internlm3"), progress=False)
    engine = LLMEngine(artifact)
    assert np.abs(chunked_logits(engine, ids, [13, 40, 41, 70]) - want).max() < LOGITS_TOL
    prompt = prompts_of([37], seed=2)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    got = None
    while engine.has_unfinished():
        got = next((o.token_ids for o in engine.step() if o.finished), got)
    assert got == hf_greedy(hf, prompt, 32)
    # transformers refuses the two biases unequal (Llama's one setting): so does its declaration
    path.write_text(json.dumps({**cfg, "bias": False}))
    with pytest.raises(CheckpointError, match="InternLM3ForCausalLM: qkv_bias True and bias False differ"):
        inspect_checkpoint(ckpt)
