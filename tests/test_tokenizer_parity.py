"""Tokenizer parity: the artifact tokenizes as transformers does; unsupported checkpoints name their nearest family.

A Qwen2 checkpoint carrying the demo's byte-level tokenizer.json (GPT-2's split regex, no NFC)
is what transformers 5 rebuilds as Qwen2Tokenizer; the build must ship that pipeline and check it.
Everything is local: random checkpoints from transformers config classes, the demo's tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import DEMO_MODEL

from compiler.checkpoint import inspect_checkpoint


def test_generation_config_eos_ids_override_config(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(DEMO_MODEL, folder)
    assert inspect_checkpoint(folder).config.eos_token_ids == (1,)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 3]}))
    assert inspect_checkpoint(folder).config.eos_token_ids == (1, 2, 3)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))  # names none: config's
    assert inspect_checkpoint(folder).config.eos_token_ids == (1,)
