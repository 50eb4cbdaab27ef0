"""The artifact's tokenizer on the HTTP side: `TextCodec` (encode, decode, one token's text for logprobs) and
`ChatTemplate` (messages -> prompt text: the tokenizer's Jinja `chat_template` in a sandbox, or the documented
fallback `### <Role>:\n<content>\n\n` ... `### Assistant:\n`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.server.errors import invalid
from runtime.tokenizer import load_tokenizer


class TextCodec:
    """The artifact's tokenizer on the HTTP side (encode, decode, one token's text for logprobs)."""

    def __init__(self, folder: Path) -> None:
        self._tok = load_tokenizer(folder)
        self.vocab_size = self._tok.get_vocab_size()
        self._pieces: dict[int, str] = {}
        # The longest token in characters: a text of more than max_model_len * this many characters
        # cannot fit the context, so it is refused before it is tokenized.
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_piece_chars = max(1, max((len(t) for t in vocab), default=1))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): the event loop runs while a worker tokenizes.
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        p = self._pieces.get(token_id)
        if p is None:
            p = self._pieces[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return p


def special_token(config: dict[str, Any], name: str) -> str:
    v = config.get(name)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


class ChatTemplate:
    """Messages -> prompt text: the tokenizer's Jinja `chat_template`, or the documented fallback."""

    def __init__(self, tokenizer_config: dict[str, Any]) -> None:
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        self.source: str | None = source if isinstance(source, str) and source.strip() else None
        self.bos_token = special_token(tokenizer_config, "bos_token")
        self.eos_token = special_token(tokenizer_config, "eos_token")
        self._template: Any = None
        if self.source is not None:
            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
            self._template = env.from_string(self.source)

    def render(self, messages: list[dict[str, str]]) -> tuple[str, bool]:
        """(prompt text, whether the tokenizer should add its special tokens such as BOS)."""
        if self._template is None:
            parts = [f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages]
            return "".join(parts) + "### Assistant:\n", True
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise invalid(f"the chat template refused these messages: {exc}", "messages") from exc
        return text, False  # templates write their own special tokens
