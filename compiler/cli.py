"""The `optimize` command line: build, inspect, verify, generate, eval.

Heavy modules (torch, onnx, onnxruntime) are imported inside the commands that need them, so
`optimize verify` and `optimize inspect` work in a runtime-only install and start fast.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # pragma: no cover
    from compiler.build import Plan

log = logging.getLogger("optimize")


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _is_reference(text: str) -> bool:
    return text.startswith("oci://") or text.startswith("file://")


def _reference_options(f: Any) -> Any:
    """--require-signature and --insecure, for commands that take a folder or a reference."""
    f = click.option("--insecure", is_flag=True, help="Plain HTTP to the registry of a reference (a local one).")(f)
    return click.option("--require-signature", type=click.Path(dir_okay=False, exists=True, path_type=Path),
                        default=None, metavar="PUB",
                        help="Refuse a reference unless signed by this Ed25519 public key (before loading).")(f)


def _resolve(artifact: str, require_signature: Path | None, insecure: bool) -> Path:
    """A local folder for ARTIFACT: a reference is pulled (or reused from the cache) and verified."""
    if not _is_reference(artifact) and require_signature is None:
        return Path(artifact)
    from runtime.artifact import ArtifactError
    from runtime.oci import resolve_artifact

    try:
        return resolve_artifact(artifact, insecure=insecure, require_signature=require_signature)
    except ArtifactError as e:
        _fail(str(e))
        raise  # unreachable: _fail exits


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Compile Hugging Face checkpoints into verified artifacts, and run them."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Check recipe and checkpoint, print the plan and estimates; build nothing.")
@click.option("--no-progress", is_flag=True, help="No progress display.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder (overrides the recipe's `output`).")
@click.option("--skip-existing", is_flag=True,
              help="If this name/version already exists and verifies intact, report it and exit 0 "
                   "(versions are immutable: it is never rebuilt or overwritten).")
@click.option("--no-autotune", is_flag=True,
              help="Choose kernels from a fixed rule table instead of timing candidates on this machine "
                   "(fast, deterministic: the same recipe gives the same bytes).")
@click.option("--force", is_flag=True,
              help="Build even when the estimated peak memory exceeds what this machine has available, or the "
                   "estimated artifact exceeds the free disk space at the output.")
def build(recipe: Path, dry_run: bool, no_progress: bool, output: Path | None, skip_existing: bool,
          no_autotune: bool, force: bool) -> None:
    """Build RECIPE (YAML) into artifacts/<name>/<version>/."""
    from compiler.build import BuildError, RecipeError, plan
    from runtime.artifact import ArtifactError, verify_artifact

    try:
        p = plan(recipe)
        if dry_run:
            _print_plan(p)
            return
        existing = (output.resolve() if output else p.recipe.output) / p.recipe.name / p.recipe.version
        if skip_existing and (existing / "manifest.json").is_file():
            problems = verify_artifact(existing)
            if problems:
                _fail(f"{existing} exists but does not verify:\n  " + "\n  ".join(problems))
            click.echo(f"exists and verified: {existing} (not rebuilt)")
            return
        from compiler.build import QualityGateError
        from compiler.build import build as run_build

        t = time.perf_counter()
        try:
            out = run_build(recipe, progress=not no_progress and sys.stderr.isatty(), output=output,
                            autotune=not no_autotune, force=force)
        except QualityGateError as e:
            _fail(f"{e}\nno artifact was written")
            return
        click.echo(f"built {out} in {time.perf_counter() - t:.1f} s")
    except RecipeError as e:
        _fail(str(e))
    except (BuildError, ArtifactError) as e:
        _fail(f"{e}\nno artifact was written")


def _print_plan(p: Plan) -> None:
    r, info, est = p.recipe, p.checkpoint, p.estimates
    cfg = info.config
    click.echo(f"recipe     {r.path}  (sha256 {r.sha256[:12]})")
    click.echo(f"artifact   {r.output / r.name / r.version}")
    click.echo(f"source     {info.path}")
    click.echo(f"           {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
               f"heads {cfg.num_heads}/{cfg.num_kv_heads} kv, head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, "
               f"{info.num_parameters:,} parameters")
    matmul = f" (matmul {r.target.matmul})" if r.target.matmul not in (None, r.target.dtype) else ""
    click.echo(f"target     {r.target.backend}/{r.target.device}/{r.target.dtype}{matmul}")
    click.echo("passes")
    for i, ps in enumerate(p.passes, 1):
        click.echo(f"  {i}. {ps.name:<12} {ps.summary}")
    click.echo("estimates")
    rows = [
        ("artifact size", est["artifact_bytes"]),
        ("build peak memory", est["build_peak_bytes"]),
        ("runtime weights", est["runtime_weights_bytes"]),
        (f"runtime KV cache ({r.runtime.num_kv_blocks} blocks x {r.runtime.kv_block_size} tokens)",
         est["runtime_kv_cache_bytes"]),
        (f"runtime activations ({r.runtime.max_num_batched_tokens} tokens/step, context {r.runtime.max_model_len})",
         est["runtime_activation_bytes"]),
        ("runtime total", est["runtime_total_bytes"]),
    ]
    for label, n in rows:
        click.echo(f"  {label:<62} {_fmt_bytes(n):>12}")
    from compiler.memory import check_memory, mem_available

    available = mem_available()
    weights = "streamed (read one tensor at a time as the artifact is written)" if p.streamed else \
        f"loaded (the whole model in memory: {p.loads_model_because})"
    click.echo(f"build weights {weights}")
    click.echo("build memory (estimated peak resident set per pass)")
    for name, n in p.pass_peaks.items():
        click.echo(f"  {name:<62} {_fmt_bytes(n):>12}")
    if available is not None:
        click.echo(f"  {'available (MemAvailable)':<62} {_fmt_bytes(available):>12}")
    problem = check_memory(p.pass_peaks)
    if problem is not None:
        click.echo(f"warning: {problem}")
    from compiler.disk import check_disk, disk_free, needed_bytes

    out = r.output / r.name / r.version
    free = disk_free(out)
    if free is not None:
        click.echo(f"build disk: the artifact needs about {_fmt_bytes(needed_bytes(est['artifact_bytes']))}; "
                   f"{_fmt_bytes(free[1])} free at {free[0]}")
    problem = check_disk(out, est["artifact_bytes"])
    if problem is not None:
        click.echo(f"warning: {problem}")
    click.echo("plan ok (dry run: nothing built)")


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(artifact: Path, as_json: bool) -> None:
    """Summarise an artifact's manifest."""
    from runtime.artifact import ArtifactError, describe, read_manifest

    try:
        manifest = read_manifest(artifact)
    except ArtifactError as e:
        _fail(str(e))
        return
    if as_json:
        click.echo(json.dumps(manifest, indent=2, sort_keys=True))
        return
    rows = describe(manifest)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        # the gate's row is the one line verify and serve print too ("quality: ..."), so one grep finds it
        click.echo(f"quality: {v}" if k == "quality" else f"{k:<{width}}  {v}")


@main.command()
@click.argument("artifact")
@click.option("--key", "public_key", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="For a reference: require a signature by this Ed25519 public key (optimize keygen).")
@click.option("--insecure", is_flag=True, help="Plain HTTP to the registry (a local one), not TLS.")
def verify(artifact: str, public_key: Path | None, insecure: bool) -> None:
    """Check every file of ARTIFACT against its manifest (size and sha256); exit 1 on any difference.

    ARTIFACT may be a reference (oci://HOST/REPO:TAG, file:///DIR/REPO:TAG): with --key its signature is
    checked, and its files are pulled into the cache and verified."""
    from runtime.artifact import ArtifactError, read_manifest, verify_artifact

    if _is_reference(artifact):
        _verify_reference(artifact, public_key, insecure)
        return
    if public_key is not None:
        _fail("--key checks the signature of a reference (oci://... or file://...), not of a folder")
    try:
        manifest = read_manifest(Path(artifact))
        problems = verify_artifact(Path(artifact))
    except ArtifactError as e:
        _fail(str(e))
        return
    if problems:
        for line in problems:
            click.echo(f"FAILED {line}", err=True)
        _fail(f"{artifact}: {len(problems)} problem(s)")
    click.echo(f"ok: {manifest['name']} {manifest['version']}, {len(manifest.get('files', []))} files verified")
    _echo_quality(manifest)


def _sampling(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
              stop: tuple[str, ...]) -> object:
    from runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop=list(stop))


@main.command()
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
@_reference_options
def generate(artifact: str, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int | None, stop: tuple[str, ...], escapes: bool, device: str | None,
             cuda_graphs: str | None, retune: bool, require_signature: Path | None, insecure: bool) -> None:
    """Stream a continuation of PROMPT from ARTIFACT (a folder, or a reference: pulled and verified first)."""
    from runtime.artifact import ArtifactError
    from runtime.engine import LLM

    if escapes:
        prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    folder = _resolve(artifact, require_signature, insecure)
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
        _fail(str(e))


@main.command("eval")
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
        _fail(str(e))
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


@main.command()
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
@_reference_options
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

    folder = _resolve(artifact, require_signature, insecure)
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
        _fail(str(e))
        return
    sys.exit(run_server(config, announce=lambda line: click.echo(line, err=line.startswith("error:"))))


@main.command()
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
        _fail(str(e))
        return
    click.echo(format_table(report))
    if output_json is not None:
        detail = [{k: v for k, v in asdict(r).items()} for r in results]
        output_json.write_text(json.dumps({**report, "per_request": detail}, indent=2) + "\n", encoding="utf-8")
        click.echo(f"wrote {output_json}")
    if report["requests"]["completed"] == 0:
        _fail("no request completed")

# --------------------------------------------------------------------------- registries: publish, pull, sign


def _verify_reference(ref: str, public_key: Path | None, insecure: bool) -> None:
    from runtime.artifact import ArtifactError, read_manifest
    from runtime.oci import pull, verify_signature

    try:
        if public_key is not None:
            digest, key_id = verify_signature(ref, public_key, insecure=insecure)
            click.echo(f"signature ok: {ref} ({digest}) signed by {key_id}")
        result = pull(ref, insecure=insecure)
    except ArtifactError as e:
        _fail(str(e))
        return
    click.echo(f"ok: {ref} ({result.digest}) verified at {result.path}")
    _echo_quality(read_manifest(result.path))


def _echo_quality(manifest: dict[str, object]) -> None:
    """verify's last line: the build's quality gate, e.g. "quality: not evaluated (reason); ..."."""
    from runtime.artifact import quality_line

    click.echo(f"quality: {quality_line(manifest.get('quality'))}")


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("ref")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              metavar="KEY", help="Attach an Ed25519 signature (optimize keygen) as a referrer of the artifact.")
@click.option("--insecure", is_flag=True, help="Plain HTTP to the registry (a local one), not TLS.")
def publish(artifact: Path, ref: str, sign_key: Path | None, insecure: bool) -> None:
    """Publish ARTIFACT to REF: oci://HOST[:PORT]/REPO[:TAG] or file:///DIR/REPO[:TAG] (TAG: the version).

    A tag is immutable: publishing other content under an existing tag is refused; the same content
    again changes nothing."""
    from runtime.artifact import ArtifactError
    from runtime.oci import publish as publish_artifact

    try:
        result = publish_artifact(artifact, ref, insecure=insecure, sign_key=sign_key)
    except ArtifactError as e:
        _fail(str(e))
        return
    if result.already:
        click.echo(f"{result.reference} already holds {result.digest}: nothing to publish")
    else:
        click.echo(f"published {result.reference} ({result.digest}), {result.uploaded} blob(s) uploaded")
    if result.signed:
        click.echo(f"signed {result.digest} with {sign_key}")


@main.command()
@click.argument("ref")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder to create (default: the cache, $XDG_CACHE_HOME/optimize/artifacts/<digest>).")
@_reference_options
def pull(ref: str, output: Path | None, require_signature: Path | None, insecure: bool) -> None:
    """Fetch REF into the local cache (digests checked while streaming) and materialize a verified folder."""
    from runtime.artifact import ArtifactError
    from runtime.oci import pull as pull_artifact

    try:
        result = pull_artifact(ref, output, insecure=insecure, require_signature=require_signature)
    except ArtifactError as e:
        _fail(str(e))
        return
    verb = "reused" if result.reused else "pulled"
    click.echo(f"{verb} {result.reference} ({result.digest}) into {result.path}")


@main.command()
@click.option("-o", "--output", default="optimize-signing", show_default=True, metavar="PREFIX",
              help="Writes PREFIX.key (private, mode 0600) and PREFIX.pub.")
def keygen(output: str) -> None:
    """Create an Ed25519 key pair for signing artifacts (publish --sign, verify --key, --require-signature)."""
    from runtime.oci import SignatureError
    from runtime.oci import keygen as make_keys

    try:
        key_id = make_keys(Path(f"{output}.key"), Path(f"{output}.pub"))
    except (SignatureError, OSError) as e:
        _fail(str(e))
        return
    click.echo(f"wrote {output}.key and {output}.pub (key {key_id})")


@main.command("list")
@click.argument("repo")
@click.option("--json", "as_json", is_flag=True)
@click.option("--insecure", is_flag=True, help="Plain HTTP to the registry (a local one), not TLS.")
def list_cmd(repo: str, as_json: bool, insecure: bool) -> None:
    """Tags of REPO (oci://HOST/REPO or file:///DIR/REPO) with name, version, created, target and quality."""
    from compiler.publish import format_list, list_tags
    from runtime.artifact import ArtifactError

    try:
        rows = list_tags(repo, insecure=insecure)
    except ArtifactError as e:
        _fail(str(e))
        return
    click.echo(json.dumps(rows, indent=2) if as_json else format_list(rows))


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True)
@click.option("--insecure", is_flag=True, help="Plain HTTP to the registry (a local one), not TLS.")
def diff(a: str, b: str, as_json: bool, insecure: bool) -> None:
    """Compare two artifacts (folders or references): recipe, passes, kernels, quantization, quality, files."""
    from compiler.publish import diff_artifacts, format_diff
    from runtime.artifact import ArtifactError

    try:
        result = diff_artifacts(a, b, insecure=insecure)
    except ArtifactError as e:
        _fail(str(e))
        return
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_diff(result))


if __name__ == "__main__":  # pragma: no cover
    main()
