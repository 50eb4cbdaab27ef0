"""Shared fixtures: the demo artifact (built once per session) and small random checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "pycode-llama-6m"
DEMO_RECIPE = ROOT / "recipes" / "demo.yaml"


def _ort_lacks() -> dict[str, str | None]:
    """Why the installed ONNX Runtime release cannot run a feature that a later release added (None: it
    can): the features runtime/ort_releases.py lists, and the contrib-op inputs/schemas the build checks."""
    from compiler.attention.schema import missing_input
    from runtime import ort_releases

    return {"fp8_activations": ort_releases.missing(ort_releases.FP8_ACTIVATIONS_CPU),
            "fp8_kv_cache": ort_releases.missing(ort_releases.FP8_KV_CACHE),
            "gqa": missing_input("GroupQueryAttention", "query_seqlens"),
            "paged_attention": missing_input("PagedAttention", "block_table"),
            "int4_cast": ort_releases.missing(ort_releases.CAST21_CPU)}


ORT_LACKS = _ort_lacks()


def needs_ort(feature: str) -> pytest.MarkDecorator:
    """Skip where the installed ONNX Runtime is a release older than the feature (pyproject's floor is 1.20;
    the build refuses the feature there with the reason, which tests/test_ort_releases.py checks). CI installs
    the newest release, where nothing is skipped."""
    why = ORT_LACKS[feature]
    return pytest.mark.skipif(why is not None, reason=f"onnxruntime release: {why}")


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> object:
    """torch's intra-op thread count is process-wide: a test that loads a torch artifact with threads=1
    (runtime/backends/pytorch.py) would leave every later build in the session on one core."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """recipes/demo.yaml built once into a temporary output folder, with --no-autotune (the fixed rule
    table: deterministic; tests/test_cli_build.py builds it once as the README does, autotuning)."""
    from compiler.build import build

    out = tmp_path_factory.mktemp("demo-artifacts")
    return build(DEMO_RECIPE, progress=False, output=out, autotune=False)


@pytest.fixture(scope="session")
def tiny_vocab_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a 32-token vocabulary (peaked: its weights are scaled up), built with a
    `speculative:` section: its first layer, a 1-layer draft, is built alongside and paired in the manifest."""
    from compiler.build import build

    folder = tmp_path_factory.mktemp("tiny-vocab")
    ckpt = make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=3, vocab_size=32)
    extra = "speculative:\n  num_tokens: 3\n  draft:\n    truncate_layers: 1\n"
    return build(write_recipe(folder, ckpt, name="tiny-vocab", extra=extra), progress=False, autotune=False)


def write_recipe(folder: Path, checkpoint: Path, name: str = "test-model", passes: str | None = None,
                 extra: str = "", runtime: str | None = None, backend: str = "onnxruntime", device: str = "cpu",
                 dtype: str = "float32", matmul: str | None = None) -> Path:
    """A recipe file for `checkpoint` in `folder` (absolute paths), output to folder/artifacts."""
    default = "  - name: capture\n  - name: package\n" if backend == "torch" else \
        "  - name: capture\n  - name: lower_onnx\n  - name: package\n"
    passes = passes or default
    runtime = runtime or ("  kv_block_size: 16\n  num_kv_blocks: 256\n  max_num_seqs: 8\n"
                          "  max_num_batched_tokens: 256\n  max_model_len: 512\n")
    text = (f"name: {name}\nversion: 1.0.0\nsource:\n  checkpoint: {checkpoint}\n"
            f"target:\n  backend: {backend}\n  device: {device}\n  dtype: {dtype}\n"
            + (f"  matmul: {matmul}\n" if matmul else "")
            + f"passes:\n{passes}runtime:\n{runtime}{extra}output: {folder / 'artifacts'}\n")
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


NORM_SPREAD = 0.3  # the norm weights of random checkpoints: init +- this (uniform)


def make_random_checkpoint(folder: Path, arch: str, seed: int = 0, **overrides: object) -> Path:
    """A small random Hugging Face checkpoint (safetensors + the demo tokenizer), GQA; every parameter has
    random values, the norm weights included (NORM_SPREAD)."""
    import torch
    import transformers

    common = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    if arch == "LlamaForCausalLM":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
    elif arch == "MistralForCausalLM":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
    elif arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**common)
    elif arch == "Qwen3ForCausalLM":
        cfg = transformers.Qwen3Config(**common, head_dim=16)
    elif arch == "Phi3ForCausalLM":  # fused qkv_proj / gate_up_proj in the checkpoint
        cfg = transformers.Phi3Config(**common, rope_theta=10000.0)
    elif arch == "Olmo2ForCausalLM":  # post-norm, q/k RMSNorm over the whole projection
        cfg = transformers.Olmo2Config(**common)
    elif arch == "Gemma2ForCausalLM":  # head_dim 16 as Qwen3's; a window of 24 on the even layers
        cfg = transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    elif arch == "Gemma3ForCausalLM":  # a local (sliding) and a global layer, each with its own RoPE
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
        cfg = transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                                            layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    elif arch == "GraniteForCausalLM":  # multipliers as Granite 3's, the attention's for head_dim 16
        cfg = transformers.GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.2, logits_scaling=8.0, rope_theta=10000.0)
    elif arch == "MixtralForCausalLM":  # 4 experts, top 2, renormalised
        cfg = transformers.MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=None, rope_theta=10000.0)
    elif arch == "Qwen2MoeForCausalLM":  # un-normalised top 2 of 4, a shared expert; layer 1 dense (mlp_only_layers)
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, norm_topk_prob=False,
                                          mlp_only_layers=[1])
    elif arch == "Qwen3MoeForCausalLM":  # normalised top 2 of 8 (as Qwen3-30B-A3B: norm_topk_prob)
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True)
    elif arch == "InternLM3ForCausalLM":  # no class of that name: transformers builds internlm3 as LlamaForCausalLM
        cfg = transformers.InternLM3Config(**common, head_dim=16)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = (getattr(transformers, arch, None) or transformers.AutoModelForCausalLM.from_config)(cfg).eval()
    with torch.no_grad():  # larger weights than the init so logits are far from uniform
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not p.any():  # a router left at zero: random (ties would pick experts arbitrarily)
                p.normal_(0.0, 0.08)
            elif p.ndim >= 2:  # (3-D: transformers 5's fused experts)
                p.mul_(4.0)
            elif name.endswith(".bias"):  # transformers initialises biases to 0 (Qwen2's QKV bias)
                p.normal_(0.0, 0.5)
            else:  # norm weights: each its own values around its init (1, or 0 for Gemma's 1 + w), so that
                # a norm swapped for another, dropped or misread changes the output
                p.add_(torch.empty_like(p).uniform_(-NORM_SPREAD, NORM_SPREAD))
        others = [n for n, p in model.named_parameters() if p.ndim == 1 and not n.endswith((".bias", "norm.weight"))]
        assert not others, f"1-D parameters this helper does not know how to randomise: {others}"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(DEMO_MODEL / f, folder / f)
    config = json.loads((folder / "config.json").read_text())  # written and readable
    if config["architectures"] != [arch]:  # the name the checkpoints on the Hub carry, not transformers' class
        (folder / "config.json").write_text(json.dumps({**config, "architectures": [arch]}, indent=2))
    return folder
