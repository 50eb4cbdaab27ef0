"""Checkpoint loading: sharded safetensors, bf16/fp16 weights, tied embeddings, refusals, source hash.

The model definition is run eagerly in torch here (no export) and compared with transformers.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import transformers
from conftest import DEMO_MODEL, make_random_checkpoint

from compiler.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    HashStopped,
    inspect_checkpoint,
    load_weights,
    source_sha256,
)
from compiler.models.llama import LlamaForwardBatchModel


def eager_logits(path: Path, ids: list[int]) -> torch.Tensor:
    info = inspect_checkpoint(path)
    model = LlamaForwardBatchModel(info.config, block_size=16)
    model.load_hf_state_dict(load_weights(info), torch.float32)
    model.eval()
    cfg = info.config
    n = len(ids)
    kv = [torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    with torch.no_grad():
        out = model(torch.tensor(ids), torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), torch.arange(n), *kv)
    return out[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_half_precision_tied_checkpoint(tmp_path: Path, dtype: torch.dtype) -> None:
    src = make_random_checkpoint(tmp_path / "src", "LlamaForCausalLM", tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    dst = tmp_path / "sharded"
    model.save_pretrained(dst, max_shard_size="200KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, dst / f)
    info = inspect_checkpoint(dst)
    assert len(info.weight_files) > 1
    assert (dst / "model.safetensors.index.json").is_file()
    assert info.config.tie_word_embeddings
    assert "lm_head.weight" not in info.tensors
    ids = list(range(3, 40))
    ref = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = eager_logits(dst, ids)
    assert (got - want).abs().max().item() < 1e-4


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(folder)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    assert all(a in msg for a in SUPPORTED_ARCHITECTURES)


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pickle"
    folder.mkdir()
    shutil.copyfile(DEMO_MODEL / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="only pickle weights"):
        inspect_checkpoint(folder)


def test_source_hash_covers_weights_and_config(tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(DEMO_MODEL, folder)
    base = source_sha256(inspect_checkpoint(folder))
    assert base == source_sha256(inspect_checkpoint(DEMO_MODEL))
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-10] ^= 0x01
    (folder / "model.safetensors").write_bytes(bytes(data))
    changed = source_sha256(inspect_checkpoint(folder))
    assert changed != base
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (folder / "config.json").write_text(json.dumps(cfg))
    assert source_sha256(inspect_checkpoint(folder)) != changed
    # a build that ends early stops the hash it started beside its passes
    stop = threading.Event()
    assert source_sha256(inspect_checkpoint(folder), stop) == source_sha256(inspect_checkpoint(folder))
    stop.set()
    with pytest.raises(HashStopped, match="config.json"):
        source_sha256(inspect_checkpoint(folder), stop)


def test_inspect_reads_no_weights_and_counts_parameters() -> None:
    info = inspect_checkpoint(DEMO_MODEL)
    assert info.num_parameters == 6_327_552  # the model card's count
    assert info.config.num_kv_heads == 2 and info.config.num_heads == 8
