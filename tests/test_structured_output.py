"""Structured output: the engine's grammar-constrained requests, the grammar cache, and the server's
response_format / vLLM guided fields through the official openai client. (The sampler's token masks, C against
its twin, are in tests/test_sampling.py, which scripts/memcheck.sh also runs under the sanitizers.)

The demo model (6M parameters, trained on Python) babbles at temperature 1, so every valid output here is the
grammar's doing: the masks force it, and a request ends when its grammar is complete. Schemas are bounded
(maxLength, maxItems, integer ranges, no additional properties) so that every sample completes within
max_tokens; an unbounded one (any JSON object) need not.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from test_server import API_KEY, MODEL, ServerProcess, post

from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams
from runtime.structured import Grammars, StructuredOutput, StructuredOutputError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["module", "class", "function"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "count": {"type": "integer", "minimum": -5, "maximum": 50},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                 "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "score", "count", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})"
CHOICES = ["def", "class", "import", "return"]
N = 100  # samples per constraint at temperature 1.0

# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(demo_artifact: Path) -> LLMEngine:
    return LLMEngine(demo_artifact)


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> tuple[dict, list[set[str]]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, steps = {}, []
    while engine.has_unfinished():
        outs = engine.step()
        steps.append({o.request_id for o in outs})
        final.update({o.request_id: o for o in outs if o.finished})
    return final, steps


def test_constrained_and_free_rows_batched_leave_the_free_one_unchanged(engine: LLMEngine) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone, _ = _run(engine, {"alone": ("def parse(text):\n", free)})
    together, steps = _run(engine, {
        "json": ("import json\n", SamplingParams(max_tokens=300, temperature=1.0, seed=3,
                                                  structured=StructuredOutput.json_schema(SCHEMA))),
        "free": ("def parse(text):\n", free),
        "regex": ("x = ", SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput("regex", REGEX))),
    })
    assert sum(1 for s in steps if {"json", "free"} <= s) >= 10  # they really shared steps
    assert together["free"].token_ids == alone["alone"].token_ids
    jsonschema.validate(json.loads(together["json"].text), SCHEMA)
    assert together["json"].finish_reason == "stop" and re.fullmatch(REGEX, together["regex"].text)


def test_grammar_kinds_and_completion_in_the_engine(engine: LLMEngine) -> None:
    specs = {
        "choice": (StructuredOutput.choice(CHOICES), lambda t: t in CHOICES),
        "lark": (StructuredOutput("grammar", 'start: "x = " NUM ("+" NUM)* "\\n"\nNUM: /[0-9]{1,3}/'),
                 lambda t: re.fullmatch(r"x = [0-9]{1,3}(\+[0-9]{1,3})*\n", t)),
        "gbnf": (StructuredOutput("grammar", 'root ::= "def " [a-z_]{1,10} "():"'),
                 lambda t: re.fullmatch(r"def [a-z_]{1,10}\(\):", t)),
    }
    final, _ = _run(engine, {f"{k}-{i}": ("def f():\n    ", SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                                                                             structured=spec))
                             for k, (spec, _) in specs.items() for i in range(8)})
    for rid, out in final.items():
        assert out.finish_reason == "stop" and specs[rid.split("-")[0]][1](out.text), (rid, out.text)
    # ignore_eos does not keep a complete grammar going
    final, _ = _run(engine, {"c": ("x", SamplingParams(max_tokens=50, ignore_eos=True,
                                                       structured=StructuredOutput.choice(["yes"])))})
    assert final["c"].text == "yes" and final["c"].finish_reason == "stop"


def test_compiled_grammars_are_cached_lru(demo_artifact: Path) -> None:
    g = Grammars(demo_artifact / "tokenizer" / "tokenizer.json", 4096, [1], cache_size=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first = g.compile(a)
    assert g.compile(a) is first and (g.stats["compiled"], g.stats["hits"]) == (1, 1)
    g.compile(b)
    g.compile(c)  # evicts a, the least recently used
    assert g.compile(a) is not first and g.stats["compiled"] == 4
    m1, m2 = g.matcher(b), g.matcher(b)
    assert m1 is not m2 and m1.consume_token(g._tok().tokenize_str("b")[0])
    with pytest.raises(StructuredOutputError, match="invalid regex"):
        g.compile(StructuredOutput("regex", "(unclosed"))
    with pytest.raises(StructuredOutputError, match="invalid JSON schema"):
        g.compile(StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}))


def test_structured_output_imports_no_torch(demo_artifact: Path) -> None:
    """The grammar engine is part of the thin runtime: a constrained request imports neither torch nor
    transformers (xgrammar would: docs/architecture.md, "Structured output")."""
    code = (f"import json, sys\nfrom runtime import LLM, SamplingParams, StructuredOutput\n"
            f"out = LLM({str(demo_artifact)!r}).generate(['x = '], SamplingParams(max_tokens=30, "
            f"structured=StructuredOutput('regex', '[0-9]{{3}}')))[0]\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'compiler'))\n"
            "print(json.dumps([heavy, out.text, out.finish_reason]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    heavy, text, reason = json.loads(res.stdout.strip().splitlines()[-1])
    assert heavy == [] and re.fullmatch("[0-9]{3}", text) and reason == "stop"


def test_missing_llguidance_names_the_install(demo_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    g = Grammars(demo_artifact / "tokenizer" / "tokenizer.json", 4096, [1])
    with pytest.raises(StructuredOutputError, match="pip install llguidance"):
        g.compile(StructuredOutput("regex", "a+"))


# --------------------------------------------------------------------------------------------
# The server, through the official openai client
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(demo_artifact: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(demo_artifact, "--api-key", API_KEY)
    yield s
    s.kill()


def test_json_schema_regex_and_choice_100_of_100_at_temperature_1(server: ServerProcess) -> None:
    """N samples per constraint, all in flight together (continuous batching), both endpoints."""
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}

    async def run() -> tuple[list, list, list]:
        client = server.async_client()
        schema = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "An item"}],
                                                 response_format=rf, temperature=1.0, seed=i, max_tokens=400)
                  if i % 2 else
                  client.completions.create(model=MODEL, prompt="item = ", temperature=1.0, seed=i, max_tokens=400,
                                            extra_body={"response_format": rf})
                  for i in range(N)]
        regex = [client.completions.create(model=MODEL, prompt="ip = ", temperature=1.0, seed=i, max_tokens=60,
                                           extra_body={"guided_regex": REGEX}) for i in range(N)]
        choice = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A keyword"}],
                                                 temperature=1.0, seed=i, max_tokens=20,
                                                 extra_body={"structured_outputs": {"choice": CHOICES}})
                  for i in range(N)]
        return (await asyncio.gather(*schema), await asyncio.gather(*regex), await asyncio.gather(*choice))

    schema, regex, choice = asyncio.run(run())

    def text(r) -> str:  # noqa: ANN001
        return r.choices[0].message.content if r.object == "chat.completion" else r.choices[0].text

    for r in schema:
        jsonschema.validate(json.loads(text(r)), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
    assert len({text(r) for r in schema}) > N // 2  # sampled, not one answer
    assert all(re.fullmatch(REGEX, text(r)) and r.choices[0].finish_reason == "stop" for r in regex)
    assert all(text(r) in CHOICES and r.choices[0].finish_reason == "stop" for r in choice)
    assert {text(r) for r in choice} == set(CHOICES)


def test_every_field_spelling_on_both_endpoints(server: ServerProcess) -> None:
    client = server.client()
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
             "required": ["ok", "n"], "additionalProperties": False}
    bodies = [
        {"guided_json": small}, {"guided_json": json.dumps(small)}, {"structured_outputs": {"json": small}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": small}}},
    ]
    for body in bodies:
        r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=50, extra_body=body)
        jsonschema.validate(json.loads(r.choices[0].text), small)
        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=50,
                                           extra_body=body)
        jsonschema.validate(json.loads(c.choices[0].message.content), small)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= "a" [0-9] "b"'})
    assert re.fullmatch(r"a[0-9]b", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[a-c]{2}"}})
    assert re.fullmatch("[a-c]{2}", r.choices[0].text)
    # any JSON object: unbounded (strings, nesting), so only an output that ends with its grammar ("stop") is sure
    # to parse; one cut by max_tokens is a prefix of one
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "An object"}], n=8,
                                       seed=5, max_tokens=200, response_format={"type": "json_object"})
    assert any(c.finish_reason == "stop" for c in r.choices)
    for c in r.choices:
        assert isinstance(json.loads(c.message.content), dict) if c.finish_reason == "stop" else \
            c.message.content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="def main():\n", max_tokens=300, temperature=0,
                                  extra_body={"structured_outputs": {"json_object": True}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def test_streaming_logprobs_stop_strings_and_n(server: ServerProcess) -> None:
    client = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "An item"}],
                                            response_format=rf, temperature=1.0, seed=7, max_tokens=400, stream=True,
                                            logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    parts, lps, reasons, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            lps.extend(ch.logprobs.content if ch.logprobs and ch.logprobs.content else [])
            reasons.append(ch.finish_reason)
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    assert reasons[-1] == "stop" and usage is not None and len(lps) == usage.completion_tokens
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps)
    # the same request not streamed: the same text (seeded)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "An item"}],
                                           response_format=rf, temperature=1.0, seed=7, max_tokens=400)
    assert whole.choices[0].message.content == "".join(parts)
    # a stop string cuts the constrained output like any other
    r = client.completions.create(model=MODEL, prompt="ip = ", max_tokens=60, stop=["."], temperature=1.0, seed=1,
                                  extra_body={"guided_regex": REGEX})
    assert re.fullmatch(r"0|[1-9][0-9]{0,2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    # max_tokens before the grammar completes: cut, "length"
    r = client.completions.create(model=MODEL, prompt="item = ", max_tokens=5, extra_body={"guided_json": SCHEMA})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith('{"name":"')
    # n samples, each with its own matcher; completions logprobs count the tokens
    r = client.completions.create(model=MODEL, prompt="ip = ", max_tokens=60, n=4, seed=3, logprobs=1,
                                  extra_body={"guided_regex": REGEX})
    for c in r.choices:
        # one logprob per token: the text's, then EOS where the model ended it (not where the grammar did)
        assert re.fullmatch(REGEX, c.text) and "".join(c.logprobs.tokens).startswith(c.text)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json", "strin"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ({"structured_outputs": {"json": {"$ref": "#/$defs/Nope"}}}, "structured_outputs", "Nope"),
])
def test_invalid_constraints_are_400_and_the_server_keeps_serving(server: ServerProcess, body: dict, param: str,
                                                                   message: str) -> None:
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                                {"messages": [{"role": "user", "content": "x"}]})):
        status, _, err = post(server.port, path, {"model": MODEL, "max_tokens": 8, **extra, **body})
        assert status == 400, err
        assert err["error"]["param"] == param and message in err["error"]["message"], err
    with pytest.raises(openai.BadRequestError, match=message):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=body)
    r = server.client().completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "ok"})
    assert r.choices[0].text == "ok"
