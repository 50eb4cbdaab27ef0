"""Request fields: each body field read and checked (type, range, Unicode) with a 400 that names it: numbers,
booleans, stop strings, messages, the output constraint (response_format, vLLM's guided_* and
structured_outputs), `speculative`, and the fields refused unless neutral."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from runtime.sampling import SamplingParams
from runtime.server.config import MAX_STOP, MAX_STOP_CHARS
from runtime.server.errors import invalid
from runtime.speculative import SpeculativeConfig
from runtime.structured import StructuredOutput, StructuredOutputError

MISSING = object()


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(body: dict[str, Any], name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(name, MISSING)
    if v is MISSING or v is None:
        return default
    if not is_int(v):
        raise invalid(f"{name} must be an integer, got {show(v)}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise invalid(f"{name} must be {_range(lo, hi)}, got {v}", name)
    return v


def number_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float | None = None,
                 lo_open: bool = False) -> float:
    v = body.get(name, MISSING)
    if v is MISSING or v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise invalid(f"{name} must be a number, got {show(v)}", name, "invalid_type")
    bad = v <= lo if lo_open else v < lo
    if not math.isfinite(v) or bad or (hi is not None and v > hi):
        low = f"> {lo}" if lo_open else f">= {lo}"
        raise invalid(f"{name} must be {low}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}", name)
    return float(v)


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, MISSING)
    if v is MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean, got {show(v)}", name, "invalid_type")
    return v


def show(v: object) -> str:
    text = json.dumps(v) if isinstance(v, str | int | float | bool | type(None)) else type(v).__name__
    return text if len(text) <= 40 else text[:39] + "…"


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def stop_field(body: dict[str, Any], max_count: int = MAX_STOP, max_chars: int = MAX_STOP_CHARS) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > max_count or any(not s for s in v):
        raise invalid(f"stop: at most {max_count} non-empty strings", "stop")
    if any(len(s) > max_chars for s in v):
        raise invalid(f"stop: each string at most {max_chars} characters", "stop")
    return list(v)


def text_field(value: str, param: str) -> str:
    """`value`, refused (400) when it cannot be UTF-8 (a lone surrogate such as "\\ud800" in the JSON)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(f"{param} is not valid Unicode text (a lone surrogate at character {exc.start})",
                      param) from None
    return value


def refuse_unsupported(body: dict[str, Any], supported: tuple[str, ...] = ()) -> None:
    """400 for a field this server does not implement, unless its value is neutral (or it is `supported`
    by the endpoint, which then validates it itself)."""
    neutral: dict[str, Callable[[Any], bool]] = {
        "logit_bias": lambda v: not v,
        "best_of": lambda v: v in (None, 1),
        "suffix": lambda v: v in (None, ""),
        "tools": lambda v: not v,
        "functions": lambda v: not v,
        "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") in (None, "text")),
    }
    for name, ok in neutral.items():
        if name in body and name not in supported and not ok(body[name]):
            raise invalid(f"{name} is not supported by this server", name, "unsupported_parameter")


_VLLM_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    """One constraint from a request field; 400 naming `param` when its shape is wrong."""
    try:
        if kind == "json":
            if not isinstance(value, dict | str):
                raise StructuredOutputError("a JSON schema must be a JSON object (or its JSON text)")
            return StructuredOutput.json_schema(value)
        if kind == "choice":
            return StructuredOutput.choice(value)
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"the {kind} must be a non-empty string")
            text_field(value, param)
        spec = StructuredOutput(kind, value if isinstance(value, str) else "")
        spec.validate()
        return spec
    except StructuredOutputError as exc:
        raise invalid(f"{param}: {exc}", param) from None


def structured(body: dict[str, Any]) -> tuple[StructuredOutput, str] | None:
    """The request's output constraint and the field it came from: OpenAI's response_format
    (json_object, json_schema), vLLM's guided_json / guided_regex / guided_choice / guided_grammar, or
    vLLM's structured_outputs {json, regex, choice, grammar, json_object}; at most one of them."""
    found: list[tuple[StructuredOutput, str]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise invalid("response_format must be an object", "response_format", "invalid_type")
        kind = rf.get("type")
        if kind == "json_object":
            found.append((StructuredOutput("json_object"), "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise invalid("response_format json_schema needs json_schema.schema, a JSON schema object",
                              "response_format")
            found.append((_constraint("json", schema, "response_format"), "response_format"))
        elif kind not in (None, "text"):
            raise invalid(f"response_format type {show(kind)} is not supported (have: text, json_object, "
                          "json_schema)", "response_format", "unsupported_parameter")
    for name, kind in _VLLM_GUIDED.items():
        if body.get(name) is not None:
            found.append((_constraint(kind, body[name], name), name))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("structured_outputs must be an object", "structured_outputs", "invalid_type")
        for key in ("json", "regex", "choice", "grammar"):
            if so.get(key) is not None:
                found.append((_constraint(key, so[key], f"structured_outputs.{key}"), "structured_outputs"))
        if so.get("json_object"):
            found.append((StructuredOutput("json_object"), "structured_outputs"))
        if so.get("structural_tag"):
            raise invalid("structured_outputs.structural_tag is not supported", "structured_outputs",
                          "unsupported_parameter")
    if len(found) > 1:
        raise invalid("give at most one output constraint (response_format json_object/json_schema, guided_json, "
                      f"guided_regex, guided_choice, guided_grammar, structured_outputs); got {len(found)}",
                      found[1][1])
    return found[0] if found else None


# Sampling fields passed on when this runtime's SamplingParams has them: (neutral, min, max).
OPTIONAL_SAMPLING: dict[str, tuple[float, float, float | None]] = {
    "presence_penalty": (0.0, -2.0, 2.0),
    "frequency_penalty": (0.0, -2.0, 2.0),
    "repetition_penalty": (1.0, 0.0, None),
    "min_p": (0.0, 0.0, 1.0),
}
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def speculative_field(body: dict[str, Any]) -> SpeculativeConfig | bool | None:
    """The request's `speculative` field: absent or null (the server's default), true / false (on with the
    server's config, else n-gram with k=4 / off), or an object {"method": "ngram", "num_tokens": k,
    "ngram_max": n, "ngram_min": m}."""
    value = body.get("speculative")
    if value is None or isinstance(value, bool):
        return value
    try:
        return SpeculativeConfig.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise invalid(f"speculative: {exc}" if not str(exc).startswith("speculative") else str(exc),
                      "speculative") from None


_ROLES = ("system", "developer", "user", "assistant", "tool")


def messages_field(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages must be a non-empty list", "messages",
                      "missing_field" if msgs is None else "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(_ROLES)}, got {show(role)}", f"{where}.role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"{where}.content: only parts of type 'text' are supported", f"{where}.content")
                texts.append(part["text"])
            content = text_field("".join(texts), f"{where}.content")
        elif isinstance(content, str):
            content = text_field(content, f"{where}.content")
        else:
            raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                          "invalid_type")
        out.append({"role": role, "content": content})
    return out


def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
