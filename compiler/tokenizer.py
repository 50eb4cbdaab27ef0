"""The artifact's tokenizer: resolved as `transformers.AutoTokenizer` resolves the checkpoint's, then
checked for parity (the runtime's ids equal transformers' ids) on a fixed text sample.

`transformers` does not always use a checkpoint's `tokenizer.json` as it is: for some families
(`model_type: qwen2` builds `Qwen2Tokenizer`) its class rebuilds the normalizer and pre-tokenizer.
The runtime tokenizes with the `tokenizers` library from the artifact's `tokenizer/tokenizer.json`,
so the build writes the pipeline transformers resolved (its backend tokenizer's JSON) there, and the
special tokens and chat template it resolved into `tokenizer_config.json`, then encodes
`PARITY_TEXTS` (plus one text made of every added token) with the runtime's own `Tokenizer` and with
transformers, with and without special tokens. Any difference fails the build, naming the text,
the token position and both ids. transformers is needed here, at build time only; the runtime reads
the files this module writes.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TOKENIZER_SOURCES = ("transformers", "file")
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")

# The fixed parity sample: code, prose, several scripts, emoji, whitespace runs, Unicode forms. The
# tokenizer's own added tokens are appended as one more text by `parity_texts`.
PARITY_TEXTS: tuple[str, ...] = (
    # code
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n\n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os, sys\r\nfor i in range(10):\r\n\tprint(f'{i:>4} {os.sep!r}')  # tab-indented\r\n",
    '{"name": "optimize", "version": "1.0.0", "list": [1, 2.5, -3e10, null, true], "nested": {"a": {}}}',
    "#include <stdio.h>\nint main(void) {\n\tchar *s = \"\\x41\\n\";\n\treturn printf(\"%s\", s) != 2;\n}\n",
    "SELECT id, COUNT(*) AS n FROM users WHERE email LIKE '%@example.com' GROUP BY id HAVING n > 1;",
    "x=1;y=2\nz = x+y*3//4**5 % 6 & 7 | 8 ^ ~9 << 10 >> 11 != 12 <= 13 >= 14 -> 15 => 16 :: 17 ... 18",
    # prose
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; we'll see—won't we? I'd say \"yes\" "
    "(or 'no'). Numbers: 1,234,567.89 and 0.001%; dates 2024-02-29; version v1.2.3-rc.4+build.5.",
    "Don't SHOUT, whisper; CamelCaseWords and snake_case_words and kebab-case-words. U.S.A. e.g. i.e. etc.",
    # several scripts
    "Größenordnung über Äpfel; naïve café, façade, coöperate, señor, Ærø, Øresund, Łódź, İstanbul, ǅ.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Ελληνικά: Γειά σου Κόσμε!",
    "中文测试：你好，世界！今天天气很好。日本語のテキスト、カタカナとひらがな。한국어 문장입니다.",
    "العربية: مرحبا بالعالم. עברית: שלום עולם. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก. ქართული ენა",
    # emoji
    "emoji: 😀😃🙂 👍🏽 👩‍👩‍👧‍👦 🇩🇪🇯🇵 ❤️ ✔︎ 🧑🏿‍💻 — done ✅",
    # whitespace runs
    "a\n\nb\n\n\nc \n d  \n\n  e\t\tf\t \t g\r\n\r\nh    i        j\u00a0k\u3000l\u2028m\u200bn",
    "   leading and trailing spaces   ",
    "\n\n\n",
    " ",
    "",
    # Unicode forms: NFD input (a normalizer that composes it changes the ids), full-width forms
    "cafe\u0301 nai\u0308ve A\u030a \u212b \uff21\uff22\uff23\uff11\uff12\uff13 ﬁ ﬀ ½ ²",
)


class TokenizerParityError(Exception):
    """The runtime's tokenizer gives other ids than transformers' for a parity text."""


@dataclass
class ResolvedTokenizer:
    """What transformers builds for a checkpoint's tokenizer, and how it differs from the files."""

    tokenizer_class: str  # the class AutoTokenizer chose, e.g. "TokenizersBackend", "Qwen2Tokenizer"
    tokenizer_json: str  # the backend pipeline as transformers built it (tokenizers' JSON)
    differs_in: tuple[str, ...]  # top-level tokenizer.json sections that differ from the file as found
    config: dict[str, Any]  # tokenizer_config.json with the special tokens and chat template transformers resolved
    config_resolved: tuple[str, ...]  # keys of `config` that differ from the file as found
    hf: Any  # the transformers tokenizer: the parity reference


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # the compiler extra installs it
        raise TokenizerParityError(
            "the build resolves the tokenizer with transformers, which is not installed "
            "(pip install '.[compiler]')") from exc
    return transformers


def _canonical(tokenizer_json: str) -> dict[str, Any]:
    """The pipeline as tokenizers serialises it, so that defaults left out of a file compare equal."""
    return json.loads(HFTokenizer.from_str(tokenizer_json).to_str())


def _special(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json writes it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(value: Any) -> Any:
    """A chat template as tokenizer_config.json holds it: a string, or a list of named templates."""
    if isinstance(value, dict):
        return [{"name": k, "template": v} for k, v in sorted(value.items())]
    return value if value else None


def resolve_tokenizer(checkpoint: Path) -> ResolvedTokenizer:
    """Load the checkpoint's tokenizer as `AutoTokenizer.from_pretrained(checkpoint)` does (local files
    only) and compare what it built with the files as found."""
    transformers = _transformers()
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ...) for a bad folder
        raise TokenizerParityError(f"{checkpoint}: transformers could not load the tokenizer: {exc}") from exc
    cls = type(hf).__name__
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerParityError(
            f"{checkpoint}: transformers resolves the tokenizer to {cls}, which has no tokenizers pipeline; "
            "the runtime tokenizes with the tokenizers library and could not reproduce it")
    resolved = backend.to_str(pretty=True)
    found = _canonical((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    mine = json.loads(backend.to_str())
    differs = tuple(sorted(k for k in set(found) | set(mine) if found.get(k) != mine.get(k)))
    cfg_path = checkpoint / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    changed: list[str] = []
    for name in SPECIAL_TOKENS:
        value = getattr(hf, name, None)
        value = value if isinstance(value, str) else None
        if value != _special(config.get(name)) and (value is not None or name in config):
            config[name] = value
            changed.append(name)
    template = _template(getattr(hf, "chat_template", None))
    if template != _template(config.get("chat_template")):
        config["chat_template"] = template
        changed.append("chat_template")
    return ResolvedTokenizer(tokenizer_class=cls, tokenizer_json=resolved, differs_in=differs, config=config,
                             config_resolved=tuple(sorted(changed)), hf=hf)


def parity_texts(hf: Any) -> list[str]:
    """PARITY_TEXTS plus one text holding every added token of `hf` (special or not), between words."""
    added = sorted((int(i), t.content) for i, t in getattr(hf, "added_tokens_decoder", {}).items())
    texts = list(PARITY_TEXTS)
    if added:
        texts.append("".join(f"{content}w{i} " for i, (_id, content) in enumerate(added)) + "end")
    return texts


def _excerpt(text: str, offset: int | None, width: int = 40) -> str:
    if offset is None or len(text) <= 2 * width:
        return repr(text)
    lo = max(0, offset - width)
    return ("..." if lo else "") + repr(text[lo:offset + width]) + ("..." if offset + width < len(text) else "")


def _difference(index: int, text: str, special: bool, got: list[int], want: list[int], runtime_tok: Any,
                hf: Any) -> str:
    """The first differing id of `got` (runtime) and `want` (transformers), in words."""
    pos = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    offsets = runtime_tok.encode(text, add_special_tokens=special).offsets
    offset = offsets[pos][0] if pos < len(offsets) else None

    def show(ids: list[int], name: Any) -> str:
        return f"{ids[pos]} {name(ids[pos])!r}" if pos < len(ids) else f"<end> after {len(ids)} tokens"

    return (f"tokenizer parity: the artifact's tokenizer and transformers' {type(hf).__name__} give different ids "
            f"for parity text {index} (add_special_tokens={special}) at token {pos}"
            + (f" (text offset {offset})" if offset is not None else "")
            + f": runtime {show(got, runtime_tok.id_to_token)}, transformers {show(want, hf.convert_ids_to_tokens)}; "
            f"text: {_excerpt(text, offset)}")


def check_parity(folder: Path, hf: Any, texts: list[str]) -> dict[str, int]:
    """Encode `texts` with the runtime's Tokenizer from `folder` and with transformers' `hf`, with and
    without special tokens; TokenizerParityError at the first differing id. Returns the sample's size."""
    runtime_tok = Tokenizer(folder)
    tokens = 0
    for index, text in enumerate(texts):
        for special in (True, False):
            want = [int(i) for i in hf.encode(text, add_special_tokens=special)]
            got = runtime_tok.encode(text, add_special_tokens=special)
            tokens += len(want)
            if got == want:
                continue
            raise TokenizerParityError(_difference(index, text, special, got, want, runtime_tok._tok, hf))
    return {"texts": len(texts), "characters": sum(len(t) for t in texts), "tokens": tokens}


def write_tokenizer(checkpoint: Path, files: tuple[Path, ...], out: Path, source: str = "transformers"
                    ) -> dict[str, Any]:
    """Write the artifact's tokenizer/ folder `out` and check its parity with transformers; returns the
    manifest's `tokenizer` record. `source`: "transformers" writes the pipeline, special tokens and chat
    template transformers resolves; "file" copies the checkpoint's files as found (the parity check
    still runs, so a file transformers would not use as it is fails the build)."""
    if source not in TOKENIZER_SOURCES:
        raise ValueError(f"tokenizer source {source!r}: one of {', '.join(TOKENIZER_SOURCES)}")
    resolved = resolve_tokenizer(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, out / f.name)
    record: dict[str, Any] = {"class": resolved.tokenizer_class}
    if source == "file" or not resolved.differs_in:
        record["source"] = "file"  # tokenizer.json as found
        if resolved.differs_in:
            log.warning("tokenizer.json as found differs from what transformers' %s builds in: %s",
                        resolved.tokenizer_class, ", ".join(resolved.differs_in))
            record["differs_from_transformers"] = list(resolved.differs_in)
    else:
        (out / "tokenizer.json").write_text(resolved.tokenizer_json, encoding="utf-8")
        record["source"] = "transformers"
        record["resolved"] = list(resolved.differs_in)
        log.info("tokenizer.json: the pipeline transformers' %s builds (it replaces the file's %s)",
                 resolved.tokenizer_class, ", ".join(resolved.differs_in))
    if source == "transformers" and resolved.config_resolved:
        (out / "tokenizer_config.json").write_text(
            json.dumps(resolved.config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
        record["config_resolved"] = list(resolved.config_resolved)
    record["parity"] = check_parity(out, resolved.hf, parity_texts(resolved.hf))
    return record


__all__ = ["PARITY_TEXTS", "ResolvedTokenizer", "TokenizerParityError", "check_parity", "parity_texts",
           "resolve_tokenizer", "write_tokenizer"]
