"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): config, checkpoint layouts, the sparse graph and
quantization with the accuracy gate.

Logits and greedy tokens against transformers on every target: tests/test_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEMO_MODEL, make_random_checkpoint, needs_ort, write_recipe
from safetensors.torch import load_file, save_file

from compiler.build import build
from compiler.checkpoint import inspect_checkpoint, load_weights
from compiler.models.llama import LlamaForwardBatchModel
from compiler.models.moe import Router, SparseMoeBlock


def _model(ckpt: Path) -> LlamaForwardBatchModel:
    info = inspect_checkpoint(ckpt)
    model = LlamaForwardBatchModel(info.config, 16).eval()
    assert model.load_hf_state_dict(load_weights(info), torch.float32) == []
    return model


def _logits(model: LlamaForwardBatchModel, ids: torch.Tensor) -> torch.Tensor:
    cfg, t = model.cfg, ids.shape[0]
    pools = [torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    with torch.no_grad():
        return model(ids, torch.arange(t), torch.tensor([0, t], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                     torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.arange(t), *pools)[0]


def test_config_of_each_family(tmp_path: Path) -> None:
    mixtral = inspect_checkpoint(make_random_checkpoint(tmp_path / "m", "MixtralForCausalLM")).config
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (4, 2, True)
    assert mixtral.moe_layers == (True, True) and mixtral.moe_intermediate_size == 48
    qwen2 = inspect_checkpoint(make_random_checkpoint(tmp_path / "q2", "Qwen2MoeForCausalLM")).config
    assert qwen2.moe_layers == (True, False)  # mlp_only_layers: [1]
    assert (qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size, qwen2.qkv_bias) == (False, 48, True)
    model = LlamaForwardBatchModel(qwen2, 16)
    assert isinstance(model.layers[0].mlp, SparseMoeBlock) and not isinstance(model.layers[1].mlp, SparseMoeBlock)
    assert model.layers[1].mlp.gate_proj.out_features == qwen2.intermediate_size
    qwen3 = inspect_checkpoint(make_random_checkpoint(tmp_path / "q3", "Qwen3MoeForCausalLM")).config
    assert (qwen3.num_experts, qwen3.norm_topk_prob, qwen3.qk_norm) == (8, True, True)
    # the routers are not Linears: no quantization pass sees them
    assert isinstance(model.layers[0].mlp.gate, Router) and isinstance(model.layers[0].mlp.shared_expert_gate, Router)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_fused_expert_tensors_load_the_same_model(arch: str, tmp_path: Path) -> None:
    """transformers 5's fused 3-D expert tensors (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])
    give the model the per-expert layouts give: Mixtral's original names (block_sparse_moe.experts.E.w1/w3/w2,
    which transformers still saves) and Qwen's (mlp.experts.E.gate_proj/up_proj/down_proj)."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", arch, seed=5)
    ids = torch.randint(3, 4096, (23,), generator=torch.Generator().manual_seed(0))
    want = _logits(_model(ckpt), ids)
    weights = load_file(ckpt / "model.safetensors")
    mixtral = arch == "MixtralForCausalLM"
    assert any(".block_sparse_moe.experts.0.w1." in n for n in weights) == mixtral
    cfg = inspect_checkpoint(ckpt).config
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {r: r for r in
                                                                                    ("gate_proj", "up_proj", "down_proj")}
    out = {n: w for n, w in weights.items() if ".experts." not in n}
    for layer in range(cfg.num_layers):
        src = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts"
        dst = f"model.layers.{layer}.mlp.experts"

        def w(e: int, role: str, src: str = src) -> torch.Tensor:
            return weights[f"{src}.{e}.{names[role]}.weight"]

        out[f"{dst}.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")])
                                                  for e in range(cfg.num_experts)])
        out[f"{dst}.down_proj"] = torch.stack([w(e, "down_proj") for e in range(cfg.num_experts)])
    (ckpt / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in out.items()}, str(ckpt / "model.safetensors"))
    torch.testing.assert_close(_logits(_model(ckpt), ids), want, rtol=0, atol=0)


def test_each_expert_runs_on_its_routed_tokens_only(tmp_path: Path) -> None:
    """The block's output equals the dense sum over the top-k experts, and each expert's Linears see
    exactly the rows routed to it (no expert computes a token it was not chosen for)."""
    model = _model(make_random_checkpoint(tmp_path / "ckpt", "Qwen3MoeForCausalLM", seed=2))
    moe = model.layers[0].mlp
    x = torch.randn(37, model.cfg.hidden_size)
    rows: dict[int, int] = {}
    hooks = [moe.experts[e].gate_proj.register_forward_hook(
        lambda m, a, o, e=e: rows.__setitem__(e, a[0].shape[0])) for e in range(len(moe.experts))]
    with torch.no_grad():
        got = moe(x)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        weights, selected = moe.route(x)
        dense = torch.stack([e(x) for e in moe.experts], 1)  # [T, E, H]
        want = (dense.gather(1, selected.unsqueeze(-1).expand(-1, -1, x.shape[1])) * weights.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(selected.reshape(-1), minlength=len(moe.experts)).tolist()
    assert [rows[e] for e in range(len(moe.experts))] == counts and sum(counts) == 37 * 2


# -- quantization with the accuracy gate ---------------------------------------------------------------------

# Bounds from a documented run (docs/architecture.md "Mixtures of experts"): Mixtral- and Qwen3-MoE-shaped random
# checkpoints (hidden 128, so groups of 128 are whole rows), 16 x 128 calibration tokens of calib.txt, 1,024 eval
# tokens. A random model's next-token distributions are nearly flat (perplexity ~5,900 on eval.txt), so small
# weight changes flip many greedy tokens: there RTN measured KL 0.040 and token agreement 0.62, AWQ 0.044 / 0.51,
# GPTQ 0.033 / 0.60 (Mixtral); Qwen3-MoE: AWQ 0.042 / 0.51, GPTQ 0.041 / 0.54. The perplexity change has a
# standard error near 1.7% on 1,024 tokens (GPTQ on Mixtral: +2.6%, interval up to +5.9%); the gate judges the
# whole 95% interval, hence 8%. The bounds sit above those runs.
QUANT = {
    "awq": "  - name: quantize_awq\n    options: {group_size: 128}\n",
    "gptq": "  - name: quantize_gptq\n    options: {group_size: 128, act_order: true}\n",
}
GATE = ("  max_perplexity_increase_pct: 8.0\n  max_kl_divergence: 0.06\n  min_token_agreement: 0.4\n")


@pytest.fixture(scope="module", params=["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def moe_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    sizes = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    if request.param == "Qwen3MoeForCausalLM":
        sizes["head_dim"] = 32
    return request.param, make_random_checkpoint(folder / "ckpt", request.param, seed=11, **sizes)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantized_experts_pass_the_accuracy_gate(moe_ckpt: tuple[str, Path], method: str, tmp_path: Path) -> None:
    arch, ckpt = moe_ckpt
    extra = (f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 16\n  seq_len: 128\n"
             f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 1024\n{GATE}")
    passes = (f"  - name: capture\n{QUANT[method]}  - name: lower_onnx\n  - name: lower_quant\n"
              "  - name: fuse\n  - name: package\n")
    recipe = write_recipe(tmp_path, ckpt, name=f"{arch.lower()}-{method}", passes=passes, extra=extra)
    artifact = build(recipe, progress=False)  # raises when the gate fails
    manifest = json.loads((artifact / "manifest.json").read_text())
    stats = next(p for p in manifest["passes"] if p["name"] == f"quantize_{method}")["stats"]
    cfg = inspect_checkpoint(ckpt).config
    experts = [f"layers.{i}.mlp.experts.{e}.{r}" for i in range(cfg.num_layers) for e in range(cfg.num_experts)
               for r in ("gate_proj", "up_proj", "down_proj")]
    assert set(experts) <= set(stats["quantized"])  # every expert's weights are INT4 ...
    assert not any(".mlp.gate" == n[-9:] for n in stats["quantized"])  # ... the routers float
    # every expert saw calibration tokens here, else it is named (rounded to nearest)
    assert stats["unseen_rtn"] == []
    quality = manifest["quality"]["metrics"]
    print(arch, method, json.dumps(quality))
    assert manifest["quality"]["passed"]
    import onnx

    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("NonZero") == cfg.num_experts * cfg.num_layers  # one row selection per expert
    assert ops.count("MatMulNBits") >= 2 * cfg.num_experts * cfg.num_layers  # gate/up fused, down


@pytest.mark.parametrize("method", ["gptq", pytest.param("fp8", marks=needs_ort("fp8_activations"))])
def test_an_expert_no_calibration_token_reaches_is_named(method: str, tmp_path: Path) -> None:
    """Routers that never pick expert 3: GPTQ rounds that expert to nearest, FP8 gives its inputs the layer's
    range of the same role, and each says so in the manifest; the artifact runs.
    (Hidden channel 0 is a positive constant: the embeddings set it and no layer writes to it; each router's
    row 3 weighs it by -1000, the others by 0.)"""
    from runtime.engine import LLMEngine
    from runtime.sampling import SamplingParams

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "MixtralForCausalLM", seed=4)
    weights = load_file(ckpt / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "w2.weight", "down_proj.weight")):
            w[0] = 0.0
        elif name.endswith("gate.weight"):  # experts 0-2 routed by the other channels as before
            w[:3, 0] = 0.0
            w[3, 0] = -1000.0
    save_file(weights, str(ckpt / "model.safetensors"))
    extra = f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 4\n  seq_len: 64\n"
    passes = (f"  - name: capture\n  - name: quantize_{method}\n  - name: lower_onnx\n  - name: lower_quant\n"
              "  - name: package\n")
    artifact = build(write_recipe(tmp_path, ckpt, name="unseen", passes=passes, extra=extra), progress=False)
    stats = next(p for p in json.loads((artifact / "manifest.json").read_text())["passes"]
                 if p["name"] == f"quantize_{method}")["stats"]
    unseen = [f"layers.{i}.mlp.experts.3.{r}" for i in range(2) for r in ("gate_proj", "up_proj", "down_proj")]
    if method == "gptq":
        assert stats["unseen_rtn"] == unseen
        assert np.isfinite(list(stats["reconstruction_loss"].values())).all()
    else:
        assert sorted(stats["unseen_amax_of_role"]) == sorted(unseen)
        amax = stats["activation_amax"]
        assert amax["layers.0.mlp.experts.3.gate_proj"] == max(amax[f"layers.0.mlp.experts.{e}.gate_proj"]
                                                               for e in range(3)) > 0
    engine = LLMEngine(artifact)
    engine.add_request("a", list(range(5, 40)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o if o.finished else out
    assert out is not None and len(out.token_ids) == 8


def test_awq_fit_search_refuses_experts_by_name(tmp_path: Path) -> None:
    """search 'fit' fits dense layers only: a mixture fails the build with a message naming the way out."""
    from compiler.passes.base import BuildError

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "MixtralForCausalLM", seed=4)
    extra = f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 2\n  seq_len: 64\n"
    passes = ("  - name: capture\n  - name: quantize_awq\n    options: {search: fit}\n  - name: lower_onnx\n"
              "  - name: lower_quant\n  - name: package\n")
    with pytest.raises(BuildError, match="search 'fit' does not cover mixture-of-experts layers; use search 'grid'"):
        build(write_recipe(tmp_path, ckpt, name="fit-moe", passes=passes, extra=extra), progress=False)
    assert not (tmp_path / "artifacts" / "fit-moe").exists()
