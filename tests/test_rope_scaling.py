"""RoPE scaling types against transformers' own computation (modeling_rope_utils.ROPE_INIT_FUNCTIONS).

The model definition computes the inverse frequencies (compiler/models/llama.py rope_inv_freq) and, for
YaRN, the attention factor it folds into the softmax scale. Each is compared with what transformers
computes from the same config. The built artifacts' logits and greedy tokens are compared with
transformers in tests/test_parity.py (Qwen2 with YaRN on every CPU target).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from compiler.checkpoint import CheckpointError, ModelConfig
from compiler.models.llama import rope_attention_factor, rope_inv_freq

BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    # Qwen2.5's long-context setting (factor 4 over its pretraining length)
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-betas-untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                               "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 100, "mscale": 1.0,
                    "mscale_all_dim": 0.8},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                              "attention_factor": 1.25},
    "yarn-no-factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def configs(params: dict) -> tuple[transformers.PretrainedConfig, ModelConfig]:
    cfg = transformers.Qwen2Config(**BASE, rope_parameters={"rope_theta": 50000.0, **params})
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg, ModelConfig.from_hf(cfg.to_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name: str) -> None:
    hf_cfg, ours = configs(CASES[name])
    want, factor = ROPE_INIT_FUNCTIONS[CASES[name]["rope_type"]](hf_cfg, torch.device("cpu"))
    got = rope_inv_freq(ours)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want.to(torch.float32), rtol=1e-6, atol=0)
    assert math.isclose(rope_attention_factor(ours), float(factor), rel_tol=1e-12)
    if name.startswith("yarn") and name != "yarn-attention-factor":  # the factor differs from 1 and is used
        assert rope_attention_factor(ours) > 1.0


def test_yarn_folds_its_attention_factor_into_the_softmax_scale() -> None:
    from compiler.models.llama import Attention

    _hf, ours = configs(CASES["yarn"])
    attn = Attention(ours, 0, "decomposed")
    assert math.isclose(attn.scale, rope_attention_factor(ours) ** 2 / math.sqrt(ours.head_dim), rel_tol=1e-12)


def test_an_unsupported_rope_type_names_the_supported_ones() -> None:
    with pytest.raises(CheckpointError, match=r"'su' is not supported \(default, linear, llama3, yarn, dynamic, longrope\)"):
        configs({"rope_type": "su", "factor": 2.0})


LONGROPE = {"rope_type": "longrope", "partial_rotary_factor": 0.5, "original_max_position_embeddings": 512,
            "short_factor": [1.0, 1.1, 1.7, 2.9, 4.0, 6.5, 9.0, 12.0], "long_factor": [1.5, 3.0, 5.0, 9.0, 14.0, 20.0, 31.0, 40.0]}


@pytest.mark.parametrize(("max_model_len", "factors"), [(None, "short"), (512, "short"), (513, "long"), (4096, "long")])
def test_longrope_picks_one_factor_set_for_the_artifacts_context(max_model_len: int | None, factors: str) -> None:
    """Partial rotary (16 of 32 dimensions) and LongRoPE: the short factors while max_model_len stays within
    the original context (what transformers uses for every forward there), the long ones beyond (what it
    uses for any forward past it); the attention factor from max_position_embeddings / original."""
    cfg = transformers.Phi3Config(**BASE, rope_parameters={"rope_theta": 10000.0, **LONGROPE},
                                  original_max_position_embeddings=512)  # Phi3Config's own key wins
    cfg.architectures = ["Phi3ForCausalLM"]
    ours = ModelConfig.from_hf(cfg.to_dict(), max_model_len=max_model_len)
    assert ours.rotary_dim == 16 and ours.rope_scaling["factors"] == factors
    seq_len = 513 if factors == "long" else None
    want, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=seq_len)
    torch.testing.assert_close(rope_inv_freq(ours), want.to(torch.float32), rtol=1e-6, atol=0)
    assert math.isclose(rope_attention_factor(ours), float(factor), rel_tol=1e-12) and factor > 1.0


def test_partial_rotary_default_frequencies() -> None:
    cfg = transformers.Phi3Config(**BASE, rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                                           "partial_rotary_factor": 0.75})
    cfg.architectures = ["Phi3ForCausalLM"]
    ours = ModelConfig.from_hf(cfg.to_dict())
    want, _ = ROPE_INIT_FUNCTIONS["default"](cfg, torch.device("cpu")) if "default" in ROPE_INIT_FUNCTIONS else \
        transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding.compute_default_rope_parameters(cfg)
    assert ours.rotary_dim == 24
    torch.testing.assert_close(rope_inv_freq(ours), want.to(torch.float32), rtol=1e-6, atol=0)


def test_longrope_factor_lists_must_fit_the_rotated_dimensions() -> None:
    cfg = transformers.Phi3Config(**BASE, rope_parameters={"rope_theta": 10000.0, **LONGROPE},
                                  original_max_position_embeddings=512)
    cfg.architectures = ["Phi3ForCausalLM"]
    d = cfg.to_dict()
    d["rope_parameters"] = {**d["rope_parameters"], "short_factor": [1.0] * 3}
    with pytest.raises(CheckpointError, match="short_factor must have rotary_dim / 2 = 8 entries"):
        ModelConfig.from_hf(d)
