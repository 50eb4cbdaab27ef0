"""The artifact's tokenizer for the runtime: tokenizers' Tokenizer from tokenizer/tokenizer.json and its config.

The engine, the server (its chat template and detokenization), the draft model's vocabulary check and the
compiler's tokenizer parity check all read it from here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from runtime.artifact import ArtifactError


def load_tokenizer(folder: Path) -> Any:
    """tokenizers' Tokenizer from folder/tokenizer.json; ArtifactError when it is missing or garbage."""
    path = folder / "tokenizer.json"
    try:
        tok = HFTokenizer.from_file(str(path))
        if tok.get_vocab_size() < 1:
            raise ValueError("an empty vocabulary")
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ArtifactError(f"{path}: not a readable tokenizer: {exc}") from exc
    return tok


class Tokenizer:
    """The artifact's tokenizer (tokenizers' Tokenizer from tokenizer/tokenizer.json)."""

    def __init__(self, folder: Path) -> None:
        self._tok = load_tokenizer(folder)
        cfg_path = folder / "tokenizer_config.json"
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text("utf-8")) if cfg_path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{cfg_path}: unreadable: {exc}") from exc
        if not isinstance(self.config, dict):
            raise ArtifactError(f"{cfg_path}: must hold a JSON object")
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def stream(self) -> TextStream:
        """An incremental decoder for one sequence of generated ids (`TextStream`)."""
        return TextStream(self._tok)


class TextStream:
    """One request's text, token by token (tokenizers' DecodeStream, special tokens skipped): `step(id)`
    returns the text that id completes, "" while a multi-byte character is still incomplete (the text of the
    id that starts it waits with it: a token of a space and two bytes of a three-byte character gives "" and
    then the space and the character). The chunks concatenate to `decode(ids)` but for such a held-back tail,
    which `decode` ends with U+FFFD. Each step
    decodes a few ids, so a generation of n tokens costs O(n), where decoding every prefix costs O(n^2)
    (llama's tokenizer: 21 us at 128 ids, 384 us at 2,048 per step)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token: int) -> str:
        return self._stream.step(self._tok, token) or ""
