"""The engine's incremental detokenization (runtime.tokenizer.TextStream) against decoding the whole sequence.

Any ids, the demo's tokenizer: the chunks concatenate to `Tokenizer.decode` of every prefix, but for a
held-back incomplete UTF-8 tail (which decode shows as U+FFFD, held back with the rest of its id's text); and a sampled generation's streamed text
and final text equal decode() of its tokens.
"""

from __future__ import annotations

from pathlib import Path

from conftest import DEMO_MODEL
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams
from runtime.tokenizer import Tokenizer

TOKENIZER = Tokenizer(DEMO_MODEL)
TEXT = (DEMO_MODEL / "eval.txt").read_text(encoding="utf-8")[:4000] + " ünïcödé ✓ 日本語 😀"


@st.composite
def id_sequences(draw: st.DrawFn) -> list[int]:
    if draw(st.booleans()):  # ids of real text (multi-byte characters split over byte tokens included)
        ids = TOKENIZER.encode(TEXT, add_special_tokens=False)
        start = draw(st.integers(0, len(ids) - 1))
        return ids[start:start + draw(st.integers(1, 80))]
    return draw(st.lists(st.integers(0, TOKENIZER.vocab_size - 1), min_size=1, max_size=80))


@settings(max_examples=300, deadline=None)
@given(id_sequences())
@example([3431])  # a space held back with an incomplete character
def test_stream_chunks_concatenate_to_decode_of_every_prefix(ids: list[int]) -> None:
    stream = TOKENIZER.stream()
    text = ""
    for n, tok in enumerate(ids, start=1):
        text += stream.step(tok)
        full = TOKENIZER.decode(ids[:n])
        assert full.startswith(text), (ids[:n], text, full)
        # only an incomplete tail is held back, with the rest of the text of the id that started it (id 3431 is
        # "\u0120\u00e2\u0122": a space and two bytes of a three-byte character; both wait for the third)
        assert full[len(text):] == "" or full.endswith("\ufffd"), (ids[:n], text, full)


def test_sampled_generation_streams_the_text_decode_gives(demo_artifact: Path) -> None:
    engine = LLMEngine(demo_artifact)
    params = SamplingParams(max_tokens=200, temperature=1.3, seed=11, ignore_eos=True)
    for k, prompt in enumerate(("def ", "import ", "\u00e9")):
        engine.add_request(f"r{k}", prompt, params)
    streamed: dict[str, str] = {}
    final: dict[str, tuple[str, list[int]]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.new_text
            assert out.text == streamed[out.request_id]
            if out.finished:
                final[out.request_id] = (out.text, out.token_ids)
    assert len(final) == 3
    for rid, (text, ids) in final.items():
        assert len(ids) == 200
        assert text == TOKENIZER.decode(ids) == streamed[rid], rid
