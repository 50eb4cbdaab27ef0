"""What real clients send: prompt logprobs (the engine's `prompt_logprobs=N`; the server's `echo` + `logprobs`,
`max_tokens: 0` and vLLM's `prompt_logprobs`) against transformers' log-softmax of the same prompt (the demo
model, fp32); vLLM's tokenizer endpoints; several prompts per request and n > 1, streamed
or not; best_of.

What evaluation harnesses send for loglikelihood tasks (lm-evaluation-harness `local-completions`):
`{"prompt": [[ids...]], "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0}`, then they read
`token_logprobs[ctxlen:-1]` and compare each with the best of `top_logprobs`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import DEMO_MODEL
from test_server import API_KEY, MODEL, ServerProcess, post, wait_idle

from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(demo_artifact: Path) -> list[int]:
    from runtime.tokenizer import Tokenizer

    text = (DEMO_MODEL / "eval.txt").read_text(encoding="utf-8")[:4000]
    return Tokenizer(demo_artifact / "tokenizer").encode(text)[:150]


@pytest.fixture(scope="module")
def reference(prompt_ids: list[int]) -> np.ndarray:
    """transformers' log_softmax rows [len(ids), vocab] (float64)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def expected(reference: np.ndarray, ids: list[int]) -> np.ndarray:
    return np.array([reference[i, ids[i + 1]] for i in range(len(ids) - 1)])


@pytest.mark.parametrize("chunk", [512, 48], ids=["one_chunk", "chunked"])
def test_engine_prompt_logprobs_match_transformers_with_a_warm_prefix_cache(
        demo_artifact: Path, prompt_ids: list[int], reference: np.ndarray, chunk: int) -> None:
    engine = LLMEngine(demo_artifact, max_num_batched_tokens=chunk)
    # warm the prefix cache with the same prompt: the scored request must still compute every position
    engine.add_request("warm", prompt_ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("scored", prompt_ids, SamplingParams(max_tokens=2, temperature=0.0), prompt_logprobs=3)
    engine.add_request("plain", prompt_ids[:70], SamplingParams(max_tokens=2, temperature=0.0))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
    scored, plain = final["scored"], final["plain"]
    assert plain.prompt_logprobs is None and plain.metrics.num_cached_tokens > 0  # the cache still serves others
    assert scored.metrics.num_cached_tokens == 0
    lps = scored.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt_ids) and lps[0] is None
    got = np.array([lp.logprob for lp in lps[1:]])
    assert np.abs(got - expected(reference, prompt_ids)).max() < TOL
    for i, lp in enumerate(lps[1:]):
        row, v = reference[i], reference[i, prompt_ids[i + 1]]
        assert lp.token_id == prompt_ids[i + 1]
        # rank = 1 + the tokens more likely than this one (a margin for float32 against float64 near-ties)
        assert int((row > v + TOL).sum()) + 1 <= lp.rank <= int((row > v - TOL).sum()) + 1
        assert np.abs(np.array([x for _, x in lp.top]) - np.sort(row)[::-1][:3]).max() < TOL
        assert all(abs(row[t] - x) < TOL for t, x in lp.top)
    # generation is unchanged by scoring: the same greedy tokens as a request without it
    engine.add_request("again", prompt_ids, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
    assert final["again"].token_ids == scored.token_ids


@pytest.fixture(scope="module")
def server(demo_artifact: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(demo_artifact, "--api-key", API_KEY)
    yield s
    s.kill()


def _post(server: ServerProcess, body: dict) -> tuple[int, dict]:
    status, _, parsed = post(server.port, "/v1/completions", {"model": MODEL, **body})
    return status, parsed


def test_harness_loglikelihood_request(server: ServerProcess, prompt_ids: list[int], reference: np.ndarray) -> None:
    """The request lm-evaluation-harness sends: the prompt's logprobs lead the logprobs object, then the
    one generated token's; `token_logprobs[ctxlen:-1]` is what the harness sums."""
    status, r = _post(server, {"prompt": [prompt_ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                               "temperature": 0})
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    n = len(prompt_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:n])
    assert np.abs(got - expected(reference, prompt_ids)).max() < TOL
    for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert len(top) >= 1 and max(top.values()) >= chosen - 1e-9
    pieces = np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1]
    assert lp["text_offset"] == pieces.tolist()  # each token's start in the pieces' concatenation
    assert r["usage"]["completion_tokens"] == 1


def test_max_tokens_zero_scores_the_prompt_alone(server: ServerProcess, prompt_ids: list[int],
                                                reference: np.ndarray) -> None:
    status, r = _post(server, {"prompt": prompt_ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 200, r
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt_ids) and choice["finish_reason"] == "length"
    assert np.abs(np.array(lp["token_logprobs"][1:]) - expected(reference, prompt_ids)).max() < TOL
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["total_tokens"] == len(prompt_ids)
    status, plain = _post(server, {"prompt": prompt_ids, "echo": True, "max_tokens": 0})
    assert status == 200 and plain["choices"][0]["text"] == choice["text"]  # the prompt's text, nothing after


def test_vllm_prompt_logprobs_field(server: ServerProcess, prompt_ids: list[int], reference: np.ndarray) -> None:
    status, r = _post(server, {"prompt": prompt_ids, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    assert status == 200, r
    entries = r["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    assert r["choices"][0]["logprobs"] is None  # generated-token logprobs were not asked for
    for i, entry in enumerate(entries[1:]):
        own = entry[str(prompt_ids[i + 1])]
        assert abs(own["logprob"] - reference[i, prompt_ids[i + 1]]) < TOL and own["rank"] >= 1
        assert len(entry) <= 3 and {v["rank"] for k, v in entry.items() if k != str(prompt_ids[i + 1])} <= {1, 2}


@pytest.mark.parametrize("body, param", [
    ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
    ({"prompt_logprobs": 1, "stream": True}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_what_prompt_scoring_refuses(server: ServerProcess, body: dict, param: str) -> None:
    status, r = _post(server, {"prompt": "import os", "max_tokens": 4, **body})
    assert status == 400 and r["error"]["param"] == param, r


def test_tokenizer_endpoints(server: ServerProcess, demo_artifact: Path) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info: the ids the completion endpoints would use."""
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer(demo_artifact / "tokenizer")
    text = "def f(x):\n    return x + 1\n"
    for path in ("/tokenize", "/v1/tokenize"):
        status, _, r = post(server.port, path, {"model": MODEL, "prompt": text, "return_token_strs": True})
        assert status == 200 and r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 1024 and len(r["token_strs"]) == r["count"]
    status, _, bare = post(server.port, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == tok.encode(text, add_special_tokens=False)
    status, _, chat = post(server.port, "/tokenize", {"messages": [{"role": "user", "content": "x = 1"}]})
    assert status == 200 and chat["count"] > 3
    status, _, back = post(server.port, "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(r["tokens"])
    status, _, bad = post(server.port, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/tokenizer_info")
    info = json.loads(conn.getresponse().read())
    conn.close()
    assert info["max_model_len"] == 1024 and info["vocab_size"] == tok.vocab_size


def test_a_stop_token_is_listed_among_the_logprobs(server: ServerProcess, prompt_ids: list[int]) -> None:
    """A completion that ends on EOS or a stop token id lists that token's logprob last, as OpenAI and vLLM do
    (lm-evaluation-harness reads `token_logprobs[ctxlen:-1]`: a missing last entry would cut a prompt token)."""
    status, free = _post(server, {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "logprobs": 1})
    assert status == 200
    first = free["choices"][0]["logprobs"]
    stop_id = post(server.port, "/tokenize", {"prompt": first["tokens"][0], "add_special_tokens": False})[2]["tokens"]
    status, r = _post(server, {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1,
                               "stop_token_ids": stop_id[:1]})
    assert status == 200
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 0
    assert len(lp["token_logprobs"]) == len(prompt_ids) + 1  # the prompt, then the stop token
    assert lp["tokens"][-1] == first["tokens"][0] and abs(lp["token_logprobs"][-1] - first["token_logprobs"][0]) < 1e-6


# ---- several prompts per request, n > 1 -----------------------------------------------------------------


def test_a_batch_of_prompts_equals_the_prompts_one_by_one(server: ServerProcess) -> None:
    prompts = ["def fibonacci(n):\n    if", "import os\nimport", "class Foo:\n    def", "x = [1, 2,"]
    ids = post(server.port, "/tokenize", {"prompt": prompts[1]})[2]["tokens"]
    batch = [prompts[0], ids, prompts[2], prompts[3]]  # strings and token ids mixed
    status, r = _post(server, {"prompt": batch, "max_tokens": 12, "temperature": 0, "logprobs": 1})
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    singles = [_post(server, {"prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 1})[1] for p in batch]
    assert [c["text"] for c in r["choices"]] == [s["choices"][0]["text"] for s in singles]
    for c, single in zip(r["choices"], singles, strict=True):
        assert c["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
    assert r["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert r["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)


def test_n_choices_with_a_seed_are_distinct_and_reproducible(server: ServerProcess) -> None:
    body = {"prompt": ["def f(x):\n", "import"], "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 4}
    status, a = _post(server, body)
    assert status == 200, a
    status, b = _post(server, body)
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == list(range(8)) and texts == [c["text"] for c in b["choices"]]
    assert len(set(texts[:4])) > 1 and len(set(texts[4:])) > 1  # the choices of one prompt differ
    # choice 0 of each prompt is what a request with that seed alone gives
    status, one = _post(server, {**body, "prompt": "import", "n": 1})
    assert one["choices"][0]["text"] == texts[4]
    status, _, chat = post(server.port, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x = 1"}], "max_tokens": 8, "n": 3, "seed": 3})
    assert status == 200 and [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])


def test_add_special_tokens_and_continuous_usage(server: ServerProcess) -> None:
    text = "import os\n"
    with_bos = _post(server, {"prompt": text, "max_tokens": 1, "temperature": 0})[1]["usage"]["prompt_tokens"]
    without = _post(server, {"prompt": text, "max_tokens": 1, "temperature": 0,
                             "add_special_tokens": False})[1]["usage"]["prompt_tokens"]
    assert with_bos == without + 1  # the demo tokenizer adds one BOS to a string prompt
    client = server.client()
    chunks = list(client.completions.create(
        model=MODEL, prompt=text, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices and ch.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 6
    assert all(ch.usage.prompt_tokens == with_bos for ch in chunks if ch.usage is not None)


# ---- streams of several choices, best_of ------------------------------------------------------------------


def _gather(chunks: list, chat: bool = False) -> tuple[dict[int, str], dict[int, str | None], list[int]]:
    """A stream's texts and finish reasons by choice index, and the index of each chunk in order."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    order = []
    for ch in chunks:
        for c in ch.choices:
            piece = c.delta.content if chat else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                assert c.index not in reasons, "one finish_reason per choice"
                reasons[c.index] = c.finish_reason
            order.append(c.index)
    return texts, reasons, order


def test_streamed_n_choices_equal_the_unstreamed_ones(server: ServerProcess) -> None:
    """OpenAI's shape for n > 1 in a stream: the choices interleave, each chunk names its choice's index, each
    choice ends with its own finish_reason, and include_usage's last chunk carries the whole request's usage.
    With a seed, the texts are those of the same request without stream."""
    client = server.client()
    kw = {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 3}
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, reasons, order = _gather(chunks)
    assert texts == {c.index: c.text for c in plain.choices} and len(set(texts.values())) > 1
    assert reasons == {c.index: c.finish_reason for c in plain.choices}
    assert order != sorted(order)  # interleaved as the tokens came, not one choice after another
    usage = chunks[-1].usage
    assert not chunks[-1].choices and all(ch.usage is None for ch in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    # chat: the same, with the role announced once per choice
    messages = [{"role": "user", "content": "x = 1"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, seed=5)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, seed=5,
                                                 stream=True))
    texts, reasons, _ = _gather(stream, chat=True)
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert reasons == {c.index: c.finish_reason for c in chat.choices}
    roles = [c.index for ch in stream for c in ch.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]


def test_a_streamed_list_of_prompts_equals_the_prompts_one_by_one(server: ServerProcess) -> None:
    client = server.client()
    prompts = ["def fibonacci(n):\n    if", "import os\nimport", "class Foo:\n    def"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, reasons, _ = _gather(chunks)
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0) for p in prompts]
    assert texts == {k: s.choices[0].text for k, s in enumerate(singles)}
    assert reasons == {k: s.choices[0].finish_reason for k, s in enumerate(singles)}
    assert chunks[-1].usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert chunks[-1].usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # two prompts, two choices each: choice k = prompt * n + j, as without stream
    kw = {"model": MODEL, "prompt": prompts[:2], "max_tokens": 8, "temperature": 1.0, "seed": 2, "n": 2}
    texts, _, _ = _gather(list(client.completions.create(**kw, stream=True)))
    assert texts == {c.index: c.text for c in client.completions.create(**kw).choices}


def test_a_client_leaving_a_stream_of_several_choices_aborts_them_all(server: ServerProcess) -> None:
    aborted = 'optimize_requests_finished_total{finish_reason="abort"}'
    before = wait_idle(server)
    stream = server.client().completions.create(model=MODEL, prompt=["import os\n", "def f():\n"], n=3,
                                                max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    seen = {c.index for ch, _ in zip(stream, range(12), strict=False) for c in ch.choices}
    assert seen and seen <= set(range(6))
    stream.close()  # the connection goes: its six engine requests are aborted, their KV blocks freed
    after = wait_idle(server)
    assert after["optimize_kv_blocks_used"] == 0 and after[aborted] - before[aborted] == 6


def test_best_of_returns_the_most_likely_of_its_samples(server: ServerProcess) -> None:
    """best_of = 4 with a seed draws the samples n = 4 draws with that seed, and returns the n of highest
    cumulative logprob (the sum of the sampled tokens' logprobs), the most likely first."""
    body = {"prompt": "def add(a, b):\n", "max_tokens": 10, "temperature": 1.0, "seed": 21}
    status, samples = _post(server, {**body, "n": 4, "logprobs": 0})
    assert status == 200, samples
    cum = [math.fsum(c["logprobs"]["token_logprobs"]) for c in samples["choices"]]
    texts = [c["text"] for c in samples["choices"]]
    assert len(set(texts)) > 1 and len(set(cum)) == 4  # distinct samples: the choice means something
    ranked = sorted(range(4), key=lambda j: -cum[j])
    assert ranked[0] != 0 and min(abs(a - b) for a in cum for b in cum if a != b) > 0.1  # a seed where order matters
    status, best = _post(server, {**body, "n": 1, "best_of": 4})
    assert status == 200, best
    assert [c["text"] for c in best["choices"]] == [texts[ranked[0]]] and best["choices"][0]["logprobs"] is None
    # every sample was generated: usage counts them all (as OpenAI bills best_of)
    assert best["usage"]["completion_tokens"] == samples["usage"]["completion_tokens"]
    status, two = _post(server, {**body, "n": 2, "best_of": 4, "logprobs": 0})
    assert status == 200, two
    assert [c["text"] for c in two["choices"]] == [texts[j] for j in ranked[:2]]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert [math.fsum(c["logprobs"]["token_logprobs"]) for c in two["choices"]] == \
        pytest.approx([cum[j] for j in ranked[:2]], abs=1e-5)
    # best_of = n is plain sampling (nothing is ranked)
    status, same = _post(server, {**body, "n": 4, "best_of": 4})
    assert [c["text"] for c in same["choices"]] == texts
