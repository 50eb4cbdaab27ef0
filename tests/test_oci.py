"""Publish, pull, sign and deploy by reference against a real OCI registry (CNCF distribution, Debian's
`docker-registry`, installed by scripts/system-deps.sh) on 127.0.0.1, and a plain-directory store.

One registry serves the session; the tests that damage storage or kill the registry start their own.
Every test gets an empty blob cache ($XDG_CACHE_HOME).
"""

from __future__ import annotations

import filecmp
import hashlib
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.cli import main
from runtime.artifact import MANIFEST, read_manifest, verify_artifact, write_manifest
from runtime.oci import ARTIFACT_TYPE, SignatureError

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
PROMPT = "def fibonacci(n):\n    if"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """`docker-registry serve config.yml` on 127.0.0.1:<free port>, storage in a temporary folder."""

    def __init__(self, folder: Path, htpasswd: Path | None = None) -> None:
        if not os.path.exists(REGISTRY_BIN):
            raise RuntimeError(f"{REGISTRY_BIN} is missing: run `bash scripts/system-deps.sh` (the README's "
                               "test command does)")
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.storage = folder / "storage"
        self.htpasswd = htpasswd
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        config = self.folder / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            + (f"auth:\n  htpasswd:\n    realm: optimize-test\n    path: {self.htpasswd}\n" if self.htpasswd else "")
            + f"http:\n  addr: 127.0.0.1:{self.port}\n", encoding="utf-8")
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.folder / "registry.log", "ab"))  # noqa: SIM115
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/", timeout=1) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and self.htpasswd:
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError("registry did not start:\n" + (self.folder / "registry.log").read_text())

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blob_data(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.kill()


@pytest.fixture
def own_registry(tmp_path: Path) -> Iterator[Registry]:
    """A registry of this test alone (its storage is damaged or it is killed)."""
    reg = Registry(tmp_path / "own-registry")
    yield reg
    reg.kill()


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache / "optimize"


def cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def _registry_manifest(host: str, repo: str, ref: str) -> tuple[bytes, str]:
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{ref}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read(), r.headers["Docker-Content-Digest"]


def _variant(src: Path, dest: Path, note: str) -> Path:
    """A copy of src with different content (same name and version), manifest re-written."""
    shutil.copytree(src, dest)
    (dest / "build.json").unlink()
    manifest = read_manifest(dest)
    cfg = json.loads((dest / "runtime.json").read_text())
    cfg["note"] = note
    (dest / "runtime.json").write_text(json.dumps(cfg))
    write_manifest(dest, manifest)
    assert verify_artifact(dest) == []
    return dest


def _leftovers(parent: Path, cache: Path) -> list[str]:
    found = [p.name for p in parent.iterdir() if ".pull-" in p.name]
    if cache.exists():
        found += [str(p) for p in cache.rglob(".part-*")]
    return found


def _greedy(artifact: str | Path, **kwargs: object) -> list[int]:
    from runtime.engine import LLM
    from runtime.sampling import SamplingParams

    llm = LLM(artifact, threads=1, **kwargs)  # type: ignore[arg-type]
    return list(llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids)


# --------------------------------------------------------------------------- round trip, immutability


def test_publish_pull_round_trip(registry: Registry, demo_artifact: Path, tmp_path: Path, empty_cache: Path) -> None:
    ref = f"oci://{registry.host}/demo/pycode-llama-6m"
    code, out, err = cli("publish", str(demo_artifact), ref, "--insecure")
    assert code == 0, err
    assert f"published {ref}:1.0.0" in out
    digest = re.search(r"\((sha256:[0-9a-f]{64})\)", out).group(1)  # type: ignore[union-attr]

    # the registry holds an OCI 1.1 artifact: one blob per payload file, digest = manifest.json's sha256
    raw, served = _registry_manifest(registry.host, "demo/pycode-llama-6m", "1.0.0")
    assert served == digest
    oci = json.loads(raw)
    assert oci["artifactType"] == ARTIFACT_TYPE
    manifest = read_manifest(demo_artifact)
    assert {(d["annotations"]["org.opencontainers.image.title"], d["digest"], d["size"]) for d in oci["layers"]} == \
        {(e["path"], "sha256:" + e["sha256"], e["bytes"]) for e in manifest["files"]}
    assert "build.json" not in {d["annotations"]["org.opencontainers.image.title"] for d in oci["layers"]}
    ann = oci["annotations"]
    assert ann["org.opencontainers.image.title"] == "pycode-llama-6m"
    assert ann["org.opencontainers.image.version"] == "1.0.0"
    assert ann["dev.optimize.target"] == "onnxruntime/cpu/float32"
    assert json.loads(ann["dev.optimize.quality"]) == manifest["quality"]
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", ann["org.opencontainers.image.created"])
    for layer in oci["layers"]:  # the registry's own blobs are the files' bytes
        assert registry.blob_data(layer["digest"]).stat().st_size == layer["size"]

    out_dir = tmp_path / "pulled"
    code, out, err = cli("pull", f"{ref}:1.0.0", "-o", str(out_dir), "--insecure")
    assert code == 0, err
    assert digest in out
    for entry in manifest["files"]:
        assert filecmp.cmp(demo_artifact / entry["path"], out_dir / entry["path"], shallow=False), entry["path"]
    assert (out_dir / MANIFEST).read_bytes() == (demo_artifact / MANIFEST).read_bytes()
    assert not (out_dir / "build.json").exists()
    assert len(list((empty_cache / "blobs" / "sha256").iterdir())) == len({e["sha256"] for e in manifest["files"]}) + 1
    code, out, err = cli("verify", str(out_dir))
    assert code == 0 and out.startswith("ok:"), err
    code, out, err = cli("pull", f"{ref}:1.0.0", "-o", str(out_dir), "--insecure")
    assert code == 0 and out.startswith("reused"), err  # the same content, verified: kept as it is
    (out_dir / "runtime.json").chmod(0o644)
    (out_dir / "runtime.json").write_text("{}")
    code, out, err = cli("pull", f"{ref}:1.0.0", "-o", str(out_dir), "--insecure")
    assert code == 1 and "holds something else" in err  # a folder is never overwritten
    assert (out_dir / "runtime.json").read_text() == "{}"

    # deploy by reference: LLM("oci://...") greedy output identical to the local artifact
    assert _greedy(f"{ref}:1.0.0", insecure=True) == _greedy(demo_artifact)


def test_republish_same_is_noop_other_content_refused(registry: Registry, demo_artifact: Path,
                                                      tmp_path: Path) -> None:
    ref = f"oci://{registry.host}/demo/immutable:1.0.0"
    assert cli("publish", str(demo_artifact), ref, "--insecure")[0] == 0
    first = _registry_manifest(registry.host, "demo/immutable", "1.0.0")[1]

    code, out, err = cli("publish", str(demo_artifact), ref, "--insecure")
    assert code == 0, err
    assert "already holds" in out and "nothing to publish" in out and first in out

    other = _variant(demo_artifact, tmp_path / "other", "different bytes")
    code, out, err = cli("publish", str(other), ref, "--insecure")
    assert code == 1
    ours = "sha256:" + hashlib.sha256((demo_artifact / MANIFEST).read_bytes()).hexdigest()
    theirs = "sha256:" + hashlib.sha256((other / MANIFEST).read_bytes()).hexdigest()
    assert first in err and ours in err and theirs in err and "immutable" in err
    assert _registry_manifest(registry.host, "demo/immutable", "1.0.0")[1] == first  # untouched

    code, out, err = cli("list", f"oci://{registry.host}/demo/immutable", "--json", "--insecure")
    assert code == 0, err
    (row,) = json.loads(out)
    quality = read_manifest(demo_artifact)["quality"]
    assert (row["tag"], row["digest"], row["name"], row["version"], row["target"]) == \
        ("1.0.0", first, "pycode-llama-6m", "1.0.0", "onnxruntime/cpu/float32")
    assert row["perplexity"] == quality["metrics"]["perplexity"] and row["quality_passed"] is True
    assert row["manifest_sha256"] == ours.removeprefix("sha256:")
    assert row["created"] and row["bytes"] == sum(e["bytes"] for e in read_manifest(demo_artifact)["files"])
    code, _, err = cli("list", f"oci://{registry.host}/demo/immutable")  # TLS unless --insecure
    assert code == 1 and "TLS failed" in err and "--insecure" in err
    code, out, _ = cli("list", f"oci://{registry.host}/demo/immutable", "--insecure")
    assert code == 0 and "1.0.0" in out and "onnxruntime/cpu/float32" in out and "sha256-" not in out


# --------------------------------------------------------------------------- damaged storage, killed registry


def test_flipped_byte_in_registry_storage_is_refused(own_registry: Registry, demo_artifact: Path, tmp_path: Path,
                                                    empty_cache: Path) -> None:
    ref = f"oci://{own_registry.host}/demo/flip:1.0.0"
    assert cli("publish", str(demo_artifact), ref, "--insecure")[0] == 0
    entry = next(e for e in read_manifest(demo_artifact)["files"] if e["path"] == "runtime.json")
    data = own_registry.blob_data("sha256:" + entry["sha256"])
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))

    target = tmp_path / "out" / "flip"
    target.parent.mkdir()
    code, _, err = cli("pull", ref, "-o", str(target), "--insecure")
    assert code == 1
    assert "runtime.json" in err and "does not match its digest" in err
    assert not target.exists()
    assert _leftovers(target.parent, empty_cache) == []
    assert not (empty_cache / "blobs" / "sha256" / entry["sha256"]).exists()


class CuttingProxy:
    """A plain-HTTP forwarder to the registry that, once `cut_after` bytes of a blob's body have gone
    through, calls `on_cut` (kills the registry) and drops the connection."""

    def __init__(self, upstream: str, blob: str, cut_after: int, on_cut: Callable[[], None]) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                conn = http.client.HTTPConnection(upstream, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(method, self.path, headers=headers)
                resp = conn.getresponse()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                sent = 0
                while method == "GET" and (chunk := resp.read(64 * 1024)):
                    if blob in self.path and sent + len(chunk) > cut_after:
                        self.wfile.write(chunk[: cut_after - sent])
                        self.wfile.flush()
                        proxy.cut = True
                        on_cut()
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.wfile.write(chunk)
                    sent += len(chunk)
                conn.close()

            def do_GET(self) -> None:  # noqa: N802
                self._forward("GET")

            def do_HEAD(self) -> None:  # noqa: N802
                self._forward("HEAD")

        self.cut = False
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_registry_killed_mid_pull(own_registry: Registry, demo_artifact: Path, tmp_path: Path,
                                  empty_cache: Path) -> None:
    assert cli("publish", str(demo_artifact), f"oci://{own_registry.host}/demo/kill:1.0.0", "--insecure")[0] == 0
    big = max(read_manifest(demo_artifact)["files"], key=lambda e: e["bytes"])
    proxy = CuttingProxy(own_registry.host, big["sha256"], big["bytes"] // 3, own_registry.kill)
    target = tmp_path / "deploy" / "model"
    target.parent.mkdir()
    try:
        code, _, err = cli("pull", f"oci://{proxy.host}/demo/kill:1.0.0", "-o", str(target), "--insecure")
    finally:
        proxy.close()
    assert proxy.cut and own_registry.proc is not None and own_registry.proc.poll() is not None
    assert code == 1
    assert big["path"] in err and "transfer cut after" in err
    assert not target.exists()
    assert _leftovers(target.parent, empty_cache) == []
    assert not (empty_cache / "blobs" / "sha256" / big["sha256"]).exists()

    code, _, err = cli("pull", f"oci://{own_registry.host}/demo/kill:1.0.0", "-o", str(target), "--insecure")
    assert code == 1 and "cannot reach the registry" in err  # still down: a clear error, fast
    own_registry.start()
    code, out, err = cli("pull", f"oci://{own_registry.host}/demo/kill:1.0.0", "-o", str(target), "--insecure")
    assert code == 0, err
    assert verify_artifact(target) == []

    # pinned by digest and in the cache: a restart needs no registry
    digest = re.search(r"\((sha256:[0-9a-f]{64})\)", out).group(1)  # type: ignore[union-attr]
    pinned = f"oci://{own_registry.host}/demo/kill:1.0.0@{digest}"
    code, out, err = cli("pull", pinned, "--insecure")
    assert code == 0 and out.startswith("pulled"), err
    own_registry.kill()
    code, out, err = cli("pull", pinned, "--insecure")
    assert code == 0 and out.startswith("reused"), err
    code, _, err = cli("pull", f"oci://{own_registry.host}/demo/kill:1.0.0", "--insecure")
    assert code == 1 and "cannot reach the registry" in err  # a tag must be resolved by the registry


# --------------------------------------------------------------------------- a plain directory


def test_directory_store(demo_artifact: Path, tmp_path: Path, empty_cache: Path) -> None:
    store = tmp_path / "srv" / "artifacts"
    ref = f"file://{store}/pycode"
    code, out, err = cli("publish", str(demo_artifact), ref)
    assert code == 0, err
    assert (store / "pycode" / "oci-layout").is_file()
    code, out, _ = cli("publish", str(demo_artifact), ref)
    assert code == 0 and "nothing to publish" in out
    code, _, err = cli("publish", str(_variant(demo_artifact, tmp_path / "v", "x")), f"{ref}:1.0.0")
    assert code == 1 and "already exists with digest" in err

    code, out, _ = cli("list", ref, "--json")
    assert code == 0 and [r["tag"] for r in json.loads(out)] == ["1.0.0"]

    target = tmp_path / "pulled"
    code, out, err = cli("pull", f"{ref}:1.0.0", "-o", str(target))
    assert code == 0, err
    for entry in read_manifest(demo_artifact)["files"]:
        assert filecmp.cmp(demo_artifact / entry["path"], target / entry["path"], shallow=False)

    # generate by reference: the same greedy tokens as the local folder
    code, out, err = cli("generate", f"{ref}:1.0.0", PROMPT, "--max-tokens", "6", "--no-escapes")
    code_local, out_local, _ = cli("generate", str(demo_artifact), PROMPT, "--max-tokens", "6", "--no-escapes")
    assert code == 0 and code_local == 0, err
    assert out == out_local and out.startswith(PROMPT) and len(out) > len(PROMPT)

    big = max(read_manifest(demo_artifact)["files"], key=lambda e: e["bytes"])
    blob = store / "pycode" / "blobs" / "sha256" / big["sha256"]
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as fh:
        fh.seek(12345)
        b = fh.read(1)
        fh.seek(12345)
        fh.write(bytes([b[0] ^ 0xFF]))
    shutil.rmtree(empty_cache)
    code, _, err = cli("pull", f"{ref}:1.0.0", "-o", str(tmp_path / "again"))
    assert code == 1 and big["path"] in err and "does not match its digest" in err
    assert not (tmp_path / "again").exists() and _leftovers(tmp_path, empty_cache) == []


# --------------------------------------------------------------------------- signatures, deploy by reference


def _serve(ref: str, *args: str, timeout: float = 120) -> tuple[int | None, str]:
    """Start `optimize serve REF`; (None, /v1/models body) once it answers, or (exit code, output)."""
    cmd = [sys.executable, "-m", "compiler.cli", "serve", ref, "--port", "0", "--threads", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        end = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"on http://[\d.]+:(\d+)", line)
            if m:
                while time.monotonic() < end:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/v1/models", timeout=5) as r:
                            return None, r.read().decode()
                    except OSError:
                        time.sleep(0.2)
        return proc.wait(30), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_signed_publish_and_require_signature(registry: Registry, demo_artifact: Path, tmp_path: Path,
                                              empty_cache: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    assert cli("keygen", "-o", str(keys / "release"))[0] == 0
    assert cli("keygen", "-o", str(keys / "other"))[0] == 0
    assert oct((keys / "release.key").stat().st_mode & 0o777) == "0o600"
    assert cli("keygen", "-o", str(keys / "release"))[0] == 1  # never overwrites a key
    signed = f"oci://{registry.host}/demo/signed:1.0.0"
    unsigned = f"oci://{registry.host}/demo/unsigned:1.0.0"
    code, out, err = cli("publish", str(demo_artifact), signed, "--insecure", "--sign", str(keys / "release.key"))
    assert code == 0 and "signed" in out, err
    assert cli("publish", str(demo_artifact), unsigned, "--insecure")[0] == 0

    code, out, err = cli("verify", signed, "--key", str(keys / "release.pub"), "--insecure")
    assert code == 0 and "signature ok" in out, err
    code, _, err = cli("verify", signed, "--key", str(keys / "other.pub"), "--insecure")
    assert code == 1 and "no signature verifies" in err
    code, _, err = cli("verify", unsigned, "--key", str(keys / "release.pub"), "--insecure")
    assert code == 1 and "is not signed" in err

    shutil.rmtree(empty_cache)  # `verify REF` pulled the signed artifact; start from nothing again
    with pytest.raises(SignatureError, match="no signature verifies"):
        _greedy(signed, insecure=True, require_signature=keys / "other.pub")
    assert not (empty_cache / "artifacts").exists()  # refused before anything was fetched or loaded

    code, out = _serve(signed, "--insecure", "--require-signature", str(keys / "other.pub"))
    assert code == 1 and "no signature verifies" in out
    code, out = _serve(unsigned, "--insecure", "--require-signature", str(keys / "release.pub"))
    assert code == 1 and "is not signed" in out
    assert not (empty_cache / "artifacts").exists()
    code, out = _serve(signed, "--insecure", "--require-signature", str(keys / "release.pub"))
    assert code is None, out
    card = json.loads(out)["data"][0]
    assert card["id"] == "pycode-llama-6m"
    # the served content digest is the OCI config digest: what a canary's /v1/models and /metrics name
    assert "sha256:" + card["artifact"]["manifest_sha256"] == \
        "sha256:" + hashlib.sha256((demo_artifact / MANIFEST).read_bytes()).hexdigest()
    assert len(list((empty_cache / "artifacts").iterdir())) == 1


def test_credentials_from_the_docker_config(demo_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import base64

    import bcrypt

    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text("alice:" + bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode() + "\n")
    reg = Registry(tmp_path / "auth-registry", htpasswd=htpasswd)
    try:
        ref = f"oci://{reg.host}/demo/private"
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
        code, _, err = cli("publish", str(demo_artifact), ref, "--insecure")
        assert code == 1 and "asks for credentials and none are configured" in err
        docker = tmp_path / "docker"
        docker.mkdir()
        (docker / "config.json").write_text(json.dumps(
            {"auths": {reg.host: {"auth": base64.b64encode(b"alice:s3cret").decode()}}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(docker))
        code, out, err = cli("publish", str(demo_artifact), ref, "--insecure")
        assert code == 0 and "published" in out, err
        assert cli("pull", f"{ref}:1.0.0", "-o", str(tmp_path / "pulled"), "--insecure")[0] == 0
        assert verify_artifact(tmp_path / "pulled") == []
        monkeypatch.setenv("OPTIMIZE_REGISTRY_USERNAME", "alice")
        monkeypatch.setenv("OPTIMIZE_REGISTRY_PASSWORD", "wrong")
        code, _, err = cli("list", ref, "--insecure")
        assert code == 1 and "credentials refused" in err
    finally:
        reg.kill()
