"""The runtime's commands of the `optimize` command line: generate, eval, serve and bench run an artifact
(a folder, or a registry reference pulled and verified first); `fail`, `resolve` and `reference_options` are
shared with the compiler's commands (compiler/cli.py), whose group adds these.

The engine, the server and the backends are imported inside the commands, so `optimize --help` and the
registry commands start without ONNX Runtime or torch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def is_reference(text: str) -> bool:
    return text.startswith("oci://") or text.startswith("file://")


def reference_options(f: Any) -> Any:
    """--require-signature and --insecure, for commands that take a folder or a reference."""
    f = click.option("--insecure", is_flag=True, help="Plain HTTP to the registry of a reference (a local one).")(f)
    return click.option("--require-signature", type=click.Path(dir_okay=False, exists=True, path_type=Path),
                        default=None, metavar="PUB",
                        help="Refuse a reference unless signed by this Ed25519 public key (before loading).")(f)


def resolve(artifact: str, require_signature: Path | None, insecure: bool) -> Path:
    """A local folder for ARTIFACT: a reference is pulled (or reused from the cache) and verified."""
    if not is_reference(artifact) and require_signature is None:
        return Path(artifact)
    from runtime.artifact import ArtifactError
    from runtime.oci import resolve_artifact

    try:
        return resolve_artifact(artifact, insecure=insecure, require_signature=require_signature)
    except ArtifactError as e:
        fail(str(e))
        raise  # unreachable: fail exits



def _sampling(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
              stop: tuple[str, ...]) -> object:
    from runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop=list(stop))


@click.command()
@click.argument("artifact")
@click.argument("prompt")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--escapes/--no-escapes", default=True, show_default=True, help=r"Read \n and \t in PROMPT.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Run on this device instead of the artifact's (e.g. cpu for a torch/cuda artifact).")
@click.option("--cuda-graphs", type=click.Choice(["auto", "padded", "off"]), default=None,
              help="Decode-bucket CUDA graphs (torch and ONNX Runtime CUDA artifacts): auto captures them on a "
                   "GPU; padded runs the padded static-shape step uncaptured; off runs every step eagerly.")
@click.option("--retune", is_flag=True,
              help="Re-measure the CPU code path of the package's C ops (avx512 / avx2 / baseline) on this machine "
                   "before loading and use the fastest (ONNX Runtime CPU artifacts; the attention variant is part "
                   "of the graph and stays).")
@reference_options
def generate(artifact: str, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int | None, stop: tuple[str, ...], escapes: bool, device: str | None,
             cuda_graphs: str | None, retune: bool, require_signature: Path | None, insecure: bool) -> None:
    """Stream a continuation of PROMPT from ARTIFACT (a folder, or a reference: pulled and verified first)."""
    from runtime.artifact import ArtifactError
    from runtime.engine import LLM

    if escapes:
        prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    folder = resolve(artifact, require_signature, insecure)
    try:
        llm = LLM(folder, device=device, graphs=cuda_graphs, retune=retune)
        params = _sampling(max_tokens, temperature, top_k, top_p, seed, stop)
        click.echo(prompt, nl=False)
        t = time.perf_counter()
        n = 0
        last = None
        for out in llm.stream(prompt, params):  # type: ignore[arg-type]
            click.echo(out.new_text, nl=False)
            n = len(out.token_ids)
            last = out
        dt = time.perf_counter() - t
        click.echo("")
        reason = last.finish_reason if last else "?"
        click.echo(f"[{n} tokens in {dt:.2f} s, {n / dt if dt else 0:.1f} tok/s, finish: {reason}]", err=True)
    except (ArtifactError, ValueError, RuntimeError) as e:
        fail(str(e))


@click.command("eval")
@click.argument("artifact", type=click.Path(file_okay=False, path_type=Path))
@click.option("--data", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="UTF-8 text file.")
@click.option("--reference", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A second artifact (e.g. the unquantized build) scored on the same chunks: prints the "
                   "perplexity change with its standard error (paired per-chunk differences) and 95% interval.")
@click.option("--chunk-len", default=256, show_default=True, help="Tokens per independently scored chunk.")
@click.option("--max-tokens", type=int, default=None, help="Score only the first N tokens of the text.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Run on this device instead of the artifact's (e.g. cpu for a torch/cuda artifact).")
@click.option("--cuda-graphs", type=click.Choice(["auto", "padded", "off"]), default=None,
              help="Decode-bucket CUDA graphs (torch and ONNX Runtime CUDA artifacts): auto captures them on a "
                   "GPU; padded runs the padded static-shape step uncaptured; off runs every step eagerly.")
def eval_cmd(artifact: Path, data: Path, reference: Path | None, chunk_len: int, max_tokens: int | None,
             as_json: bool, device: str | None, cuda_graphs: str | None) -> None:
    """Perplexity of ARTIFACT on a text file (non-overlapping chunks, each scored on its own); with
    --reference, the change against another artifact on the same chunks, with error bars."""
    from runtime.artifact import ArtifactError
    from runtime.engine import LLMEngine
    from runtime.evaluate import paired_delta, perplexity

    def score(path: Path) -> tuple[Any, list[int]]:
        engine = LLMEngine(path, device=device, graphs=cuda_graphs)
        ids = engine.tokenizer.encode(data.read_text(encoding="utf-8"), add_special_tokens=False)
        return perplexity(engine.backend, ids, chunk_len=chunk_len, max_tokens=max_tokens), ids

    try:
        t = time.perf_counter()
        res, ids = score(artifact)
        ref = delta = None
        if reference is not None:
            ref, ref_ids = score(reference)  # one engine at a time: the first is released by now
            if ref_ids[:res.chunks * chunk_len] != ids[:res.chunks * chunk_len]:
                raise ValueError(f"{artifact} and {reference} tokenize {data} differently: the chunks are not paired")
            delta = paired_delta(res.chunk_nll, ref.chunk_nll)
        dt = time.perf_counter() - t
    except (ArtifactError, ValueError, RuntimeError) as e:
        fail(str(e))
        return
    if as_json:
        out: dict[str, Any] = {**res.as_dict(), "seconds": round(dt, 3)}
        if ref is not None and delta is not None:
            out.update(reference=ref.as_dict(), delta=delta.as_dict())
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"perplexity {res.perplexity:.4f}  (mean NLL {res.mean_nll:.4f}, {res.predictions} predictions "
               f"in {res.chunks} chunks of {chunk_len}, {dt:.1f} s)")
    if ref is not None and delta is not None:
        lo, hi = delta.ci_pct
        click.echo(f"reference perplexity {ref.perplexity:.4f}; change {delta.pct:+.3f}% +- {delta.se_pct:.3f}% (se of "
                   f"{delta.chunks} paired chunk differences), 95% interval [{lo:+.3f}%, {hi:+.3f}%] (z {delta.z:.2f})")


@click.command()
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, help="TCP port (0: any free port; the bound one is printed).")
@click.option("--api-key", envvar="OPTIMIZE_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1/* (env OPTIMIZE_API_KEY).")
@click.option("--served-model-name", default=None, help="Model id in the API (default: the artifact's name).")
@click.option("--max-waiting", default=256, show_default=True,
              help="Requests the engine has not finished, outside its running batch, at most; beyond it: "
                   "429 with Retry-After.")
@click.option("--request-timeout", default=600.0, show_default=True, help="Seconds a request may take in all.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, help="Largest request body.")
@click.option("--shutdown-grace", default=30.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM.")
@click.option("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: runtime.json).")
@click.option("--max-num-seqs", type=int, default=None, help="Running sequences at most (default: runtime.json).")
@click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget per step (default: runtime.json).")
@click.option("--max-model-len", type=int, default=None, help="Context per sequence, at most runtime.json's.")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Run on this device instead of the artifact's (e.g. cpu for a torch/cuda artifact).")
@click.option("--cuda-graphs", type=click.Choice(["auto", "padded", "off"]), default=None,
              help="Decode-bucket CUDA graphs (torch and ONNX Runtime CUDA artifacts): auto captures them on a "
                   "GPU; padded runs the padded static-shape step uncaptured; off runs every step eagerly.")
@click.option("--header-timeout", default=10.0, show_default=True,
              help="Seconds a connection gets to send a request's headers (from opening or its last response).")
@click.option("--body-timeout", default=30.0, show_default=True, help="Seconds a request's body may take to arrive.")
@click.option("--write-timeout", default=30.0, show_default=True,
              help="Seconds a write may wait for a client that does not read; then its request is aborted.")
@click.option("--max-connections", default=512, show_default=True,
              help="Open connections at most; one more is answered 503 and closed.")
@click.option("--max-requests-per-client", default=0, show_default=True,
              help="Unfinished requests per client address at most, beyond it 429 (0: no bound).")
@click.option("--max-stop-strings", default=16, show_default=True, help="Stop strings per request at most.")
@click.option("--max-stop-chars", default=256, show_default=True, help="Characters per stop string at most.")
@click.option("--tokenizer-threads", default=2, show_default=True,
              help="Threads that tokenize prompts and render chat templates (off the event loop).")
@click.option("--cache-salt-header", default=None,
              help="Isolate the prefix cache by this request header's value (e.g. Authorization: per API key, or "
                   "a tenant header set by the gateway); default: one cache shared by all requests.")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="Allow cross-site requests from this origin (repeatable; * for any). Default: no CORS.")
@click.option("--speculative", default=None, metavar="SPEC",
              help="Speculative decoding for requests that do not set their `speculative` field: ngram, or "
                   "ngram:k=4,n=3,min=1 (k proposals per step, matching the last n..min tokens), or draft, "
                   "draft:k=4 (a draft model proposes). Default: off.")
@click.option("--draft-artifact", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The draft model of speculative method draft (same tokenizer). Default: the one the artifact's "
                   "manifest pairs (recipe `speculative:` section), loaded when --speculative is draft.")
@click.option("--retune", is_flag=True,
              help="Re-measure the CPU code path of the package's C ops (avx512 / avx2 / baseline) on this machine "
                   "before loading and use the fastest (ONNX Runtime CPU artifacts; the attention variant is part "
                   "of the graph and stays).")
@click.option("--kv-events", default=None, metavar="tcp://HOST:PORT",
              help="Publish KV-cache events (vLLM's format: ZeroMQ PUB there, replay on PORT+1) for KV-aware "
                   "routers. Carries token ids: bind an internal address. Default: off.")
@reference_options
def serve(artifact: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
          max_waiting: int, request_timeout: float, max_body_bytes: int, shutdown_grace: float,
          num_kv_blocks: int | None, max_num_seqs: int | None, max_num_batched_tokens: int | None,
          max_model_len: int | None, threads: int | None, device: str | None, cuda_graphs: str | None,
          retune: bool, require_signature: Path | None, insecure: bool, **limits: object) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics).

    ARTIFACT is a folder or a reference (oci://HOST/REPO:TAG, file:///DIR/REPO:TAG), pulled (or taken from
    the cache) and verified before anything is loaded."""
    from runtime.server import ServerConfig
    from runtime.server import serve as run_server

    folder = resolve(artifact, require_signature, insecure)
    try:
        config = ServerConfig(artifact=folder, host=host, port=port, api_key=api_key or None,
                              served_model_name=served_model_name, max_waiting=max_waiting,
                              request_timeout=request_timeout, max_body_bytes=max_body_bytes,
                              shutdown_grace=shutdown_grace, num_kv_blocks=num_kv_blocks,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, threads=threads, device=device,
                              cuda_graphs=cuda_graphs, retune=retune, **limits)  # type: ignore[arg-type]
        config.validate()
    except ValueError as e:
        fail(str(e))
        return
    sys.exit(run_server(config, announce=lambda line: click.echo(line, err=line.startswith("error:"))))


@click.command()
@click.option("--url", required=True, help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--model", default=None, help="Model id (default: the first of GET /v1/models).")
@click.option("-n", "--num-requests", default=64, show_default=True, help="Requests to send (measured).")
@click.option("-c", "--concurrency", type=int, default=None, help="Requests in flight at most.")
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Poisson arrivals per second (inf: all at once, bounded by --concurrency).")
@click.option("--input-len", default=128, show_default=True, help="Prompt length (tokens for ids, words for text).")
@click.option("--output-len", default=128, show_default=True, help="max_tokens of each request.")
@click.option("--range-ratio", default=0.0, show_default=True,
              help="Random lengths: uniform in [L*(1-r), L*(1+r)]; 0 = fixed.")
@click.option("--prompt-kind", type=click.Choice(["text", "ids"]), default="text", show_default=True,
              help="Prompts as words (any server) or random token ids (completions; exact lengths).")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Send ignore_eos so every request generates --output-len tokens.")
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Seed of prompts, lengths and arrivals.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer key (env OPENAI_API_KEY).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds per request.")
@click.option("--warmup", default=0, show_default=True, help="Unmeasured requests sent first, one at a time.")
@click.option("--goodput", multiple=True, metavar="KEY:MS",
              help="SLO for goodput, repeatable: ttft:MS, tpot:MS, e2e:MS, itl:MS.")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the report (and every request's timings) as JSON here.")
@click.option("--speculative", default=None, metavar="SPEC",
              help="Each request's speculative field: off, ngram or ngram:k=4,n=3,min=1 (default: the server's). "
                   "The report shows proposals and acceptance (per draft position) from the server's /metrics.")
def bench(url: str, endpoint: str, model: str | None, num_requests: int, concurrency: int | None,
          request_rate: float, input_len: int, output_len: int, range_ratio: float, prompt_kind: str,
          ignore_eos: bool, temperature: float, seed: int, api_key: str | None, timeout: float, warmup: int,
          goodput: tuple[str, ...], output_json: Path | None, speculative: str | None) -> None:
    """Load-test an OpenAI-compatible server: TTFT, ITL, TPOT, e2e percentiles, throughput, goodput."""
    import asyncio
    from dataclasses import asdict

    from runtime.loadgen import BenchConfig, format_table, parse_goodput, run_bench

    try:
        cfg = BenchConfig(url=url, endpoint=endpoint, model=model, num_requests=num_requests,
                          concurrency=concurrency, request_rate=request_rate, input_len=input_len,
                          output_len=output_len, range_ratio=range_ratio, prompt_kind=prompt_kind,
                          ignore_eos=ignore_eos, temperature=temperature, seed=seed, api_key=api_key,
                          timeout=timeout, warmup=warmup, goodput=parse_goodput(goodput), speculative=speculative)
        cfg.validate()
        report, results = asyncio.run(run_bench(cfg))
    except (ValueError, RuntimeError, OSError) as e:
        fail(str(e))
        return
    click.echo(format_table(report))
    if output_json is not None:
        detail = [{k: v for k, v in asdict(r).items()} for r in results]
        output_json.write_text(json.dumps({**report, "per_request": detail}, indent=2) + "\n", encoding="utf-8")
        click.echo(f"wrote {output_json}")
    if report["requests"]["completed"] == 0:
        fail("no request completed")
