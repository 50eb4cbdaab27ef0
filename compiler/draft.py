"""Draft checkpoints for speculative decoding: a truncated-layer copy of a checkpoint.

`truncate_checkpoint(src, dst, n)` writes a Hugging Face checkpoint folder holding the first `n` decoder
layers of `src` with its embeddings, final norm and LM head unchanged (config num_hidden_layers = n, and
per-layer lists such as `layer_types` cut to n), plus its tokenizer and generation files. It is the
draft a recipe's `speculative: {draft: {truncate_layers: n}}` builds alongside the target: no training,
the same tokenizer by construction, and its first layers' hidden state fed to the target's head, which
is often enough to guess the easy tokens.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

__all__ = ["truncate_checkpoint"]

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def truncate_checkpoint(src: Path, dst: Path, num_layers: int) -> Path:
    """Write the first `num_layers` decoder layers of the checkpoint at `src` to `dst` (module doc)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg = config.get("text_config", config) if "num_hidden_layers" not in config else config
    total = int(cfg["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"{src}: truncate_layers must be in [1, {total - 1}] (the checkpoint has {total} "
                         f"layers), got {num_layers}")
    cfg["num_hidden_layers"] = num_layers
    for key, value in list(cfg.items()):
        if key == "layer_types" and isinstance(value, list):
            cfg[key] = value[:num_layers]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no .safetensors weights to truncate")
    tensors = {}
    for f in files:
        for name, arr in load_file(str(f)).items():
            m = _LAYER.search(name)
            if m is None or int(m.group(1)) < num_layers:
                tensors[name] = arr
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    log.info("truncated %s to %d of %d layers in %s (%d tensors)", src, num_layers, total, dst, len(tensors))
    return dst
