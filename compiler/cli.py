"""The `optimize` command line: build, inspect, verify and the registry commands (publish, pull, keygen, list,
diff) here; the commands that run an artifact (generate, eval, serve, bench) are the runtime's own
(runtime/cli.py), added to this group.

Heavy modules (torch, onnx, onnxruntime) are imported inside the commands that need them, so
`optimize verify` and `optimize inspect` work in a runtime-only install and start fast.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from runtime.cli import bench, eval_cmd, fail, generate, is_reference, reference_options, serve

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
                fail(f"{existing} exists but does not verify:\n  " + "\n  ".join(problems))
            click.echo(f"exists and verified: {existing} (not rebuilt)")
            return
        from compiler.build import QualityGateError
        from compiler.build import build as run_build

        t = time.perf_counter()
        try:
            out = run_build(recipe, progress=not no_progress and sys.stderr.isatty(), output=output,
                            autotune=not no_autotune, force=force)
        except QualityGateError as e:
            fail(f"{e}\nno artifact was written")
            return
        click.echo(f"built {out} in {time.perf_counter() - t:.1f} s")
    except RecipeError as e:
        fail(str(e))
    except (BuildError, ArtifactError) as e:
        fail(f"{e}\nno artifact was written")


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
        fail(str(e))
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

    if is_reference(artifact):
        _verify_reference(artifact, public_key, insecure)
        return
    if public_key is not None:
        fail("--key checks the signature of a reference (oci://... or file://...), not of a folder")
    try:
        manifest = read_manifest(Path(artifact))
        problems = verify_artifact(Path(artifact))
    except ArtifactError as e:
        fail(str(e))
        return
    if problems:
        for line in problems:
            click.echo(f"FAILED {line}", err=True)
        fail(f"{artifact}: {len(problems)} problem(s)")
    click.echo(f"ok: {manifest['name']} {manifest['version']}, {len(manifest.get('files', []))} files verified")
    _echo_quality(manifest)


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
        fail(str(e))
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
        fail(str(e))
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
@reference_options
def pull(ref: str, output: Path | None, require_signature: Path | None, insecure: bool) -> None:
    """Fetch REF into the local cache (digests checked while streaming) and materialize a verified folder."""
    from runtime.artifact import ArtifactError
    from runtime.oci import pull as pull_artifact

    try:
        result = pull_artifact(ref, output, insecure=insecure, require_signature=require_signature)
    except ArtifactError as e:
        fail(str(e))
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
        fail(str(e))
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
        fail(str(e))
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
        fail(str(e))
        return
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_diff(result))


for command in (generate, eval_cmd, serve, bench):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
