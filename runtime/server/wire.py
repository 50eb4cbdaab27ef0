"""The OpenAI wire schemas of a response: the envelope, usage, choices, chunks and both logprobs shapes
(completions' legacy object, vLLM's prompt_logprobs, chat's content list), one `Format` per engine request."""

from __future__ import annotations

import time
from typing import Any

from runtime.async_engine import GenerateRequest
from runtime.engine import RequestOutput, TokenLogprob
from runtime.server.codec import TextCodec
from runtime.server.requests import Parsed


class Format:
    """One engine request's response in the OpenAI shape: the envelope and usage, its streamed chunks and
    its whole response."""

    object_name = ""
    chunk_object = ""

    def __init__(self, model: str, rid: str, codec: TextCodec) -> None:
        self.model = model
        self.rid = rid
        self.codec = codec
        self.created = int(time.time())

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, out: RequestOutput, logprobs: bool) -> dict[str, Any] | None:
        raise NotImplementedError

    def response(self, out: RequestOutput, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(Format):
    chunk_object = "text_completion"

    def __init__(self, model: str, rid: str, codec: TextCodec, echo: str | None,
                 parsed: Parsed | None = None) -> None:
        super().__init__(model, rid, codec)
        self.echo = echo
        self.parsed = parsed
        self.offset = len(echo) if echo else 0  # text_offset of the next token

    def _logprobs(self, lps: list[TokenLogprob], prompt: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; with `prompt` (echo + logprobs) the prompt's tokens come first,
        the first with null logprobs (nothing predicts it). text_offset counts the characters of the
        tokens' own pieces from 0 (a piece's text can differ from what decoding a whole sequence gives)."""
        tokens, values, tops, offsets = [], [], [], []
        if prompt is not None:
            pos = 0
            for tid, lp in zip(self.parsed.prompt_ids if self.parsed else [], prompt, strict=True):
                piece = self.codec.piece(tid)
                tokens.append(piece)
                values.append(None if lp is None else lp.logprob)
                tops.append(None if lp is None else self._top(lp))
                offsets.append(pos)
                pos += len(piece)
            self.offset = pos  # the generated tokens' offsets continue from the prompt pieces' own length
        for lp in lps:
            piece = self.codec.piece(lp.token_id)
            tokens.append(piece)
            values.append(lp.logprob)
            tops.append(self._top(lp))
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, lp: TokenLogprob) -> dict[str, float]:
        return {self.codec.piece(t): v for t, v in lp.top}

    def _vllm_prompt_logprobs(self, prompt: list[TokenLogprob | None]) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} for the token itself
        and the top N (null for the first token)."""
        out: list[dict[str, Any] | None] = []
        for lp in prompt:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.codec.piece(lp.token_id)}}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": self.codec.piece(t)})
            out.append(entry)
        return out

    def _choice(self, text: str, lps: list[TokenLogprob] | None, reason: str | None,
                prompt: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(lps, prompt) if lps is not None else None,
                "finish_reason": reason}

    def start(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [self.envelope(self.chunk_object, [self._choice(self.echo, None, None)])]

    def chunk(self, out: RequestOutput, logprobs: bool) -> dict[str, Any] | None:
        lps = (out.new_logprobs or []) + ([out.stop_logprob] if out.stop_logprob else []) if logprobs else None
        if not out.new_text and not out.finished and not lps:
            return None
        return self.envelope(self.chunk_object, [self._choice(out.new_text, lps, out.finish_reason)])

    def response(self, out: RequestOutput, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        parsed = self.parsed
        usage = self.usage(out)
        generated, reason = out.text, out.finish_reason
        if parsed is not None and parsed.score_only:  # max_tokens 0: the prompt alone
            generated, lps, reason = "", [] if lps is not None else None, "length"
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        prompt = out.prompt_logprobs if parsed is not None and parsed.echo_logprobs else None
        choice = self._choice((self.echo or "") + generated, lps, reason, prompt)
        if parsed is not None and parsed.vllm_prompt_logprobs and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
        return {**self.envelope("text_completion", [choice]), "usage": usage}


class ChatFormat(Format):
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, value: float) -> dict[str, Any]:
            piece = self.codec.piece(tid)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def start(self) -> list[dict[str, Any]]:
        return [self.envelope(self.chunk_object, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])]

    def chunk(self, out: RequestOutput, logprobs: bool) -> dict[str, Any] | None:
        lps = (out.new_logprobs or []) if logprobs else None
        if not out.new_text and not out.finished and not lps:
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta,
                                                  "logprobs": self._logprobs(lps) if lps is not None else None,
                                                  "finish_reason": out.finish_reason}])

    def response(self, out: RequestOutput, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": self._logprobs(lps) if lps is not None else None, "finish_reason": out.finish_reason}
        return {**self.envelope("chat.completion", [choice]), "usage": self.usage(out)}


Jobs = list[tuple[GenerateRequest, Format]]  # a request's engine requests, one per sample, with their formats


def indexed(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """A one-choice chunk as choice `index` of its request."""
    chunk["choices"][0]["index"] = index
    return chunk


def total_usage(usages: list[dict[str, Any]], per_prompt: int) -> dict[str, Any]:
    """The usage of a request from its samples' usages (`per_prompt` samples of each prompt in a row): each
    prompt's tokens (and cached tokens) once, every sample's completion tokens."""
    prompt = sum(u["prompt_tokens"] for u in usages[::per_prompt])
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages[::per_prompt])
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
