"""lm-evaluation-harness itself against `optimize serve`: its `local-completions` model (remote tokenizer
through /tokenizer_info and /tokenize) on three small local tasks written from the demo's held-out
eval.txt, against the same harness's `hf` backend on the demo checkpoint.

- demo_ppl (loglikelihood_rolling): word/byte perplexity and bits per byte of four held-out passages;
- demo_mc (multiple_choice): which of four lines follows a snippet (the true next line or three lines
  from elsewhere in the file);
- demo_gen (generate_until): up to 24 tokens after a snippet, greedy, until a blank line; the two
  backends' generations are compared text for text (exact match against the true next line too).

The two backends must agree: perplexities to 3 significant digits, accuracy and exact match exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import DEMO_MODEL
from test_server import MODEL, ServerProcess


def _write_tasks(folder: Path) -> None:
    text = (DEMO_MODEL / "eval.txt").read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 12]
    rng = random.Random(0)
    docs = [{"text": text[i * 3000: i * 3000 + 600]} for i in range(4)]
    mc, gen = [], []
    starts = rng.sample(range(10, len(lines) - 10), 24)
    for k, i in enumerate(starts[:16]):
        context = "\n".join(lines[i - 3:i]) + "\n"
        wrong = rng.sample([ln for j, ln in enumerate(lines) if abs(j - i) > 50], 3)
        choices = wrong[:]
        label = k % 4
        choices.insert(label, lines[i])
        mc.append({"context": context, "choices": choices, "label": label})
    for i in starts[16:]:
        gen.append({"prompt": "\n".join(lines[i - 4:i]) + "\n", "target": lines[i]})
    data = {"ppl": docs, "mc": mc, "gen": gen}
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "demo_ppl.yaml").write_text(
        f"task: demo_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        encoding="utf-8")
    (folder / "demo_mc.yaml").write_text(
        f"task: demo_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n", encoding="utf-8")
    (folder / "demo_gen.yaml").write_text(
        f"task: demo_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "target_delimiter: ''\ngeneration_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 24\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n", encoding="utf-8")


def _evaluate(model: str, model_args: str, folder: Path) -> dict:
    """The harness's results per task, plus the generations of demo_gen (in document order)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["demo_ppl", "demo_mc", "demo_gen"],
                                  task_manager=TaskManager(include_path=str(folder)), batch_size=1,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                                  log_samples=True)
    generated = [s["filtered_resps"][0] for s in sorted(out["samples"]["demo_gen"], key=lambda s: s["doc_id"])]
    return {**out["results"], "generated": generated}


def test_lm_eval_local_completions_matches_its_hf_backend(demo_artifact: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    _write_tasks(tmp_path)
    # add_bos_token=False: encode texts as the remote tokenizer does (lm-eval asks /tokenize without special
    # tokens); prefix_token_id: the demo's BOS (id 0) as every loglikelihood request's first token on both
    # sides (lm-eval 0.4.13's remote tokenizer takes `bos_token_id or eos_token_id`, which skips an id of 0)
    bos = json.loads((DEMO_MODEL / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"][0]
    assert bos["content"] == "<|bos|>"
    hf = _evaluate("hf", f"pretrained={DEMO_MODEL},dtype=float32,device=cpu,add_bos_token=False,"
                         f"prefix_token_id={bos['id']}", tmp_path)
    server = ServerProcess(demo_artifact)
    try:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        ours = _evaluate("local-completions", f"base_url={url},model={MODEL},tokenizer_backend=remote,"
                                              f"max_length=1024,num_concurrent=1,max_retries=1,custom_prefix_token_id={bos['id']}",
                          tmp_path)
    finally:
        server.kill()
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        a, b = hf["demo_ppl"][metric], ours["demo_ppl"][metric]
        assert float(f"{a:.3g}") == float(f"{b:.3g}"), (metric, a, b)
    assert ours["demo_mc"]["acc,none"] == hf["demo_mc"]["acc,none"]
    assert ours["demo_gen"]["exact_match,none"] == hf["demo_gen"]["exact_match,none"]
    # greedy generations, text for text (and not empty)
    assert ours["generated"] == hf["generated"] and sum(bool(g.strip()) for g in hf["generated"]) >= 4
    assert hf["demo_mc"]["acc,none"] > 0.25  # better than chance: the task measures something
