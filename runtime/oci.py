"""Artifacts in OCI registries and plain directories: publish, pull, signatures.

An artifact is stored as an OCI artifact (image manifest, OCI 1.1 ``artifactType``
``application/vnd.optimize.artifact.v1``):

* ``config``: the artifact's ``manifest.json`` bytes (media type ``application/vnd.optimize.manifest.v1+json``);
* ``layers``: one blob per payload file, media type ``application/vnd.optimize.file.v1``, the file's
  relative path in the ``org.opencontainers.image.title`` annotation; each blob's digest is the sha256
  that ``manifest.json`` already records, so a registry's content addressing and ``verify`` agree;
* ``annotations``: name, version, created, source sha256, target and quality numbers (``build.json`` is
  not published: it holds host facts, not payload).

A signature is an Ed25519 signature of the artifact's OCI manifest digest, pushed as a referrer
(``subject`` = the artifact manifest). Registries without the referrers API (CNCF distribution 2.x) get
the OCI 1.1 fallback: an image index under the tag ``sha256-<hex of the subject digest>``.

Two stores speak this layout: an OCI registry (``oci://HOST[:PORT]/REPO[:TAG]``, distribution HTTP
API, TLS unless ``insecure``; credentials from the docker config) and a plain directory
(``file:///ROOT/REPO[:TAG]``: ROOT/REPO is an OCI image layout, index.json updated under a lock and by
atomic rename). Pull streams each blob into a temporary file, hashes it while streaming, and renames it
into the content-addressed cache (``$XDG_CACHE_HOME/optimize/blobs/sha256/``) only on a match; the
artifact folder is assembled (hard links where possible) in a temporary folder beside the target, fully
verified, then renamed into place, so a failed pull never leaves a partial artifact.

Standard library only, plus ``cryptography`` for signatures (imported when one is made or checked).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import http.client
import io
import json
import logging
import os
import re
import shutil
import ssl
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runtime.artifact import MANIFEST, ArtifactError, read_manifest, sha256_file, verify_artifact

__all__ = [
    "ARTIFACT_TYPE",
    "OCIError",
    "PublishResult",
    "PullResult",
    "Reference",
    "SignatureError",
    "artifact_manifest",
    "cache_root",
    "is_reference",
    "open_store",
    "parse_reference",
    "publish",
    "pull",
    "resolve_artifact",
    "sign",
    "verify_signature",
]

log = logging.getLogger(__name__)

ARTIFACT_TYPE = "application/vnd.optimize.artifact.v1"
CONFIG_MEDIA_TYPE = "application/vnd.optimize.manifest.v1+json"
FILE_MEDIA_TYPE = "application/vnd.optimize.file.v1"
SIGNATURE_TYPE = "application/vnd.optimize.signature.v1"
SIGNATURE_MEDIA_TYPE = "application/vnd.optimize.signature.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"
TITLE = "org.opencontainers.image.title"
REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_PREFIX = "dev.optimize."
SIGNED_PREFIX = b"optimize-artifact-signature-v1:"
_CHUNK = 1 << 20
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_TIMEOUT = 30.0


class OCIError(ArtifactError):
    """A reference, registry or directory store refused or failed an operation; the message says which."""


class SignatureError(OCIError):
    """An artifact is unsigned, or no signature verifies with the given public key."""


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------- references


@dataclass(frozen=True)
class Reference:
    """``oci://HOST[:PORT]/REPO[:TAG][@sha256:...]`` or ``file:///ROOT/REPO[:TAG][@sha256:...]``."""

    scheme: str  # "oci" or "file"
    host: str  # registry host[:port]; the store root folder for file://
    repo: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        base = f"oci://{self.host}/{self.repo}" if self.scheme == "oci" else f"file://{self.host}/{self.repo}"
        return base + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    @property
    def reference(self) -> str:
        """The tag or digest the manifest is fetched by."""
        ref = self.digest or self.tag
        if ref is None:
            raise OCIError(f"{self}: no tag or digest")
        return ref

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.scheme, self.host, self.repo, tag, self.digest)


def is_reference(text: str | os.PathLike[str]) -> bool:
    """True for an ``oci://`` or ``file://`` reference (a str), False for a local path."""
    return isinstance(text, str) and (text.startswith("oci://") or text.startswith("file://"))


def parse_reference(text: str) -> Reference:
    """Parse a reference; a clear OCIError names what is wrong."""
    if not is_reference(text):
        raise OCIError(f"{text!r}: not a reference; expected oci://HOST[:PORT]/REPO[:TAG] or file:///DIR/REPO[:TAG]")
    scheme, rest = text.split("://", 1)
    digest = None
    if "@" in rest:
        rest, digest = rest.rsplit("@", 1)
        if not _DIGEST.match(digest):
            raise OCIError(f"{text}: digest {digest!r} must be sha256: and 64 lowercase hex digits")
    if scheme == "oci":
        host, _, path = rest.partition("/")
        if not host or not path:
            raise OCIError(f"{text}: expected oci://HOST[:PORT]/REPO[:TAG]")
    else:
        if not rest.startswith("/"):
            raise OCIError(f"{text}: a file reference needs an absolute path (file:///DIR/REPO[:TAG])")
        root, _, path = rest.rstrip("/").rpartition("/")
        host = root or "/"
        if not path:
            raise OCIError(f"{text}: expected file:///DIR/REPO[:TAG]")
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise OCIError(f"{text}: tag {tag!r} is not a valid OCI tag ([A-Za-z0-9_][A-Za-z0-9._-]*, 128 at most)")
    if not _REPO.match(path):
        raise OCIError(f"{text}: repository {path!r} must be lowercase [a-z0-9] parts separated by . _ - or /")
    return Reference(scheme, host, path, tag, digest)


# --------------------------------------------------------------------------- stores


class Store(Protocol):
    """What publish and pull need from a registry or a directory."""

    def get_manifest(self, reference: str) -> tuple[bytes, str] | None:
        """(bytes, media type) of the manifest at a tag or digest, None if there is none."""

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> None:
        """Store a manifest under a tag, or by its digest."""

    def has_blob(self, digest: str) -> bool: ...

    def put_blob(self, path: Path, digest: str, size: int) -> None: ...

    def put_blob_bytes(self, data: bytes) -> str: ...

    def open_blob(self, digest: str) -> contextlib.AbstractContextManager[BinaryIO]: ...

    def tags(self) -> list[str]: ...

    def referrers(self, digest: str) -> list[dict[str, Any]]:
        """Descriptors of the manifests whose subject is `digest`."""

    def add_referrer(self, subject: str, descriptor: dict[str, Any]) -> None:
        """Record a pushed manifest as a referrer of `subject` where the store does not do it itself."""


def _docker_credentials(host: str) -> tuple[str, str] | None:
    """(user, password) for host: OPTIMIZE_REGISTRY_USERNAME/PASSWORD, else the docker config's ``auths``."""
    user, password = os.environ.get("OPTIMIZE_REGISTRY_USERNAME"), os.environ.get("OPTIMIZE_REGISTRY_PASSWORD")
    if user and password:
        return user, password
    folder = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auths = config.get("auths") if isinstance(config, dict) else None
    if not isinstance(auths, dict):
        return None
    for key, entry in auths.items():
        name = key.split("://", 1)[-1].split("/", 1)[0]
        if name == host and isinstance(entry, dict) and isinstance(entry.get("auth"), str):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode("utf-8").partition(":")
            except (ValueError, UnicodeDecodeError) as exc:
                raise OCIError(f"{folder / 'config.json'}: the auth entry for {host} is not base64 user:password") \
                    from exc
            return user, password
    if config.get("credsStore") or config.get("credHelpers"):
        log.warning("%s: credential helpers are not supported; set OPTIMIZE_REGISTRY_USERNAME/PASSWORD",
                    folder / "config.json")
    return None


class RegistryStore:
    """One repository of an OCI registry over the distribution HTTP API."""

    def __init__(self, ref: Reference, insecure: bool = False, timeout: float = _TIMEOUT) -> None:
        self.ref = ref
        self.insecure = insecure
        self.timeout = timeout
        self._auth: str | None = None
        self._creds = _docker_credentials(ref.host)
        self._api_referrers: bool | None = None

    # ---- HTTP

    def _connect(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        if scheme == "https":
            return http.client.HTTPSConnection(netloc, timeout=self.timeout, context=ssl.create_default_context())
        return http.client.HTTPConnection(netloc, timeout=self.timeout)

    def _url(self, path: str) -> str:
        return f"{'http' if self.insecure else 'https'}://{self.ref.host}{path}"

    def _send(self, method: str, url: str, headers: dict[str, str], body: bytes | BinaryIO | None,
              ) -> http.client.HTTPResponse:
        for _ in range(6):  # redirects (blob storage back ends)
            parts = urllib.parse.urlsplit(url)
            conn = self._connect(parts.scheme, parts.netloc)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            hdrs = dict(headers)
            if self._auth and parts.netloc == self.ref.host:
                hdrs["Authorization"] = self._auth
            try:
                conn.request(method, target, body=body, headers=hdrs)
                resp = conn.getresponse()
            except ssl.SSLError as exc:
                conn.close()
                raise OCIError(f"{self.ref.host}: TLS failed ({exc}); for a plain-HTTP registry pass --insecure") \
                    from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise OCIError(f"{self.ref.host}: cannot reach the registry ({method} {parts.path}): {exc}") from exc
            if resp.status in (301, 302, 303, 307, 308) and method in ("GET", "HEAD"):
                url = urllib.parse.urljoin(url, resp.getheader("Location", ""))
                resp.read()
                conn.close()
                continue
            return resp
        raise OCIError(f"{self.ref.host}: too many redirects for {method} {url}")

    def _authenticate(self, challenge: str) -> None:
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic":
            if not self._creds:
                raise OCIError(f"{self.ref.host}: the registry asks for credentials and none are configured "
                               "(docker login, DOCKER_CONFIG, or OPTIMIZE_REGISTRY_USERNAME/PASSWORD)")
            token = base64.b64encode(f"{self._creds[0]}:{self._creds[1]}".encode()).decode()
            self._auth = f"Basic {token}"
            return
        if scheme.lower() != "bearer":
            raise OCIError(f"{self.ref.host}: unsupported authentication scheme {scheme!r}")
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        realm = fields.pop("realm", None)
        if not realm:
            raise OCIError(f"{self.ref.host}: bearer challenge without a realm: {challenge!r}")
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(fields)
        headers = {}
        if self._creds:
            headers["Authorization"] = "Basic " + base64.b64encode(
                f"{self._creds[0]}:{self._creds[1]}".encode()).decode()
        saved, self._auth = self._auth, None
        resp = self._send("GET", url, headers, None)
        body = resp.read()
        if resp.status != 200:
            self._auth = saved
            raise OCIError(f"{self.ref.host}: token request to {realm} refused (HTTP {resp.status})")
        data = json.loads(body)
        self._auth = f"Bearer {data.get('token') or data.get('access_token')}"

    def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | BinaryIO | None = None, url: str | None = None) -> http.client.HTTPResponse:
        headers = headers or {}
        full = url or self._url(path)
        resp = self._send(method, full, headers, body)
        if resp.status == 401:
            challenge = resp.getheader("WWW-Authenticate", "")
            resp.read()
            self._authenticate(challenge)
            if hasattr(body, "seek"):
                body.seek(0)  # type: ignore[union-attr]
            resp = self._send(method, full, headers, body)
            if resp.status == 401:
                resp.read()
                raise OCIError(f"{self.ref.host}: credentials refused for {self.ref.repo}")
        return resp

    def _error(self, resp: http.client.HTTPResponse, what: str) -> OCIError:
        text = resp.read()[:2000].decode("utf-8", "replace")
        with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
            errors = json.loads(text)["errors"]
            text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
        return OCIError(f"{self.ref.host}/{self.ref.repo}: {what} failed (HTTP {resp.status}): {text}")

    # ---- Store

    def get_manifest(self, reference: str) -> tuple[bytes, str] | None:
        resp = self.request("GET", f"/v2/{self.ref.repo}/manifests/{reference}",
                            {"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"})
        if resp.status == 404:
            resp.read()
            return None
        if resp.status != 200:
            raise self._error(resp, f"GET manifest {reference}")
        return resp.read(), (resp.getheader("Content-Type") or "").split(";")[0]

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> None:
        resp = self.request("PUT", f"/v2/{self.ref.repo}/manifests/{reference}",
                            {"Content-Type": media_type, "Content-Length": str(len(data))}, data)
        if resp.status not in (200, 201):
            raise self._error(resp, f"PUT manifest {reference}")
        resp.read()
        if resp.getheader("OCI-Subject"):
            self._api_referrers = True

    def has_blob(self, digest: str) -> bool:
        resp = self.request("HEAD", f"/v2/{self.ref.repo}/blobs/{digest}")
        resp.read()
        if resp.status == 200:
            return True
        if resp.status == 404:
            return False
        raise OCIError(f"{self.ref.host}/{self.ref.repo}: HEAD blob {digest} failed (HTTP {resp.status})")

    def _upload(self, body: bytes | BinaryIO, digest: str, size: int) -> None:
        resp = self.request("POST", f"/v2/{self.ref.repo}/blobs/uploads/", {"Content-Length": "0"}, b"")
        if resp.status != 202:
            raise self._error(resp, "start of blob upload")
        resp.read()
        location = urllib.parse.urljoin(self._url("/"), resp.getheader("Location", ""))
        location += ("&" if "?" in location else "?") + urllib.parse.urlencode({"digest": digest})
        resp = self.request("PUT", "", {"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                            body, url=location)
        if resp.status != 201:
            raise self._error(resp, f"upload of blob {digest}")
        resp.read()

    def put_blob(self, path: Path, digest: str, size: int) -> None:
        with open(path, "rb") as fh:  # monolithic upload, streamed from the file
            self._upload(fh, digest, size)

    def put_blob_bytes(self, data: bytes) -> str:
        digest = _sha(data)
        if not self.has_blob(digest):
            self._upload(data, digest, len(data))
        return digest

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        resp = self.request("GET", f"/v2/{self.ref.repo}/blobs/{digest}")
        if resp.status != 200:
            raise self._error(resp, f"GET blob {digest}")
        try:
            yield resp  # type: ignore[misc]
        finally:
            resp.close()

    def tags(self) -> list[str]:
        out: list[str] = []
        path: str | None = f"/v2/{self.ref.repo}/tags/list?n=1000"
        while path:
            resp = self.request("GET", path)
            if resp.status == 404:
                resp.read()
                return out
            if resp.status != 200:
                raise self._error(resp, "tag list")
            out += [t for t in json.loads(resp.read()).get("tags") or [] if not t.startswith("sha256-")]
            link = resp.getheader("Link")
            match = re.match(r"<([^>]+)>", link or "")
            path = match.group(1) if match else None
        return sorted(out)

    def referrers(self, digest: str) -> list[dict[str, Any]]:
        resp = self.request("GET", f"/v2/{self.ref.repo}/referrers/{digest}", {"Accept": OCI_INDEX})
        if resp.status == 200 and (resp.getheader("Content-Type") or "").startswith(OCI_INDEX):
            self._api_referrers = True
            return list(json.loads(resp.read()).get("manifests") or [])
        resp.read()
        self._api_referrers = False
        return _fallback_referrers(self, digest)

    def add_referrer(self, subject: str, descriptor: dict[str, Any]) -> None:
        if self._api_referrers is None:
            self.referrers(subject)
        if not self._api_referrers:
            _add_fallback_referrer(self, subject, descriptor)


def _fallback_tag(digest: str) -> str:
    return digest.replace(":", "-")


def _fallback_referrers(store: Store, digest: str) -> list[dict[str, Any]]:
    got = store.get_manifest(_fallback_tag(digest))
    if got is None:
        return []
    return list(json.loads(got[0]).get("manifests") or [])


def _add_fallback_referrer(store: Store, subject: str, descriptor: dict[str, Any]) -> None:
    manifests = [d for d in _fallback_referrers(store, subject) if d.get("digest") != descriptor["digest"]]
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [*manifests, descriptor]}
    store.put_manifest(_canonical(index), OCI_INDEX, _fallback_tag(subject))


class LayoutStore:
    """An OCI image layout folder (ROOT/REPO) for teams without a registry."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref
        self.root = Path(ref.host) / ref.repo
        self.blobs = self.root / "blobs" / "sha256"

    def _blob_path(self, digest: str) -> Path:
        if not _DIGEST.match(digest):
            raise OCIError(f"{self.root}: malformed digest {digest!r}")
        return self.blobs / digest.split(":", 1)[1]

    def _index(self) -> dict[str, Any]:
        path = self.root / "index.json"
        if not path.is_file():
            return {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OCIError(f"{path}: unreadable OCI layout index: {exc}") from exc
        if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
            raise OCIError(f"{path}: not an OCI image index")
        return index

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.blobs.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def get_manifest(self, reference: str) -> tuple[bytes, str] | None:
        if _DIGEST.match(reference):
            path = self._blob_path(reference)
            if not path.is_file():
                return None
            data = path.read_bytes()
            return data, str(json.loads(data).get("mediaType", OCI_MANIFEST))
        for desc in self._index()["manifests"]:
            if (desc.get("annotations") or {}).get(REF_NAME) == reference:
                path = self._blob_path(desc["digest"])
                if not path.is_file():
                    raise OCIError(f"{self.root}: tag {reference} names {desc['digest']}, whose blob is missing")
                return path.read_bytes(), desc.get("mediaType", OCI_MANIFEST)
        return None

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> None:
        digest = self.put_blob_bytes(data)
        desc: dict[str, Any] = {"mediaType": media_type, "digest": digest, "size": len(data)}
        with contextlib.suppress(ValueError, AttributeError):
            if json.loads(data).get("artifactType"):
                desc["artifactType"] = json.loads(data)["artifactType"]
        with self._locked():
            index = self._index()
            kept = []
            for d in index["manifests"]:
                name = (d.get("annotations") or {}).get(REF_NAME)
                if name == reference and not _DIGEST.match(reference):
                    if d["digest"] != digest and not reference.startswith("sha256-"):
                        raise OCIError(f"{self.ref.with_tag(reference)} already holds {d['digest']}; "
                                       f"refusing to overwrite it with {digest}")
                    continue  # replaced (the referrers index of the fallback schema) or the same
                if name is None and d["digest"] == digest:
                    continue
                kept.append(d)
            if not _DIGEST.match(reference):
                desc["annotations"] = {REF_NAME: reference}
            index["manifests"] = [*kept, desc]
            layout = self.root / "oci-layout"
            if not layout.is_file():
                layout.write_text('{"imageLayoutVersion":"1.0.0"}', encoding="utf-8")
            tmp = self.root / f".index.json.{os.getpid()}.tmp"
            tmp.write_bytes(_canonical(index))
            os.replace(tmp, self.root / "index.json")

    def has_blob(self, digest: str) -> bool:
        return self._blob_path(digest).is_file()

    def _store(self, src: BinaryIO, digest: str) -> None:
        target = self._blob_path(digest)
        self.blobs.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.blobs, prefix=".upload-")
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if "sha256:" + h.hexdigest() != digest:
                raise OCIError(f"{self.root}: blob content does not match {digest}")
            os.chmod(tmp, 0o444)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def put_blob(self, path: Path, digest: str, size: int) -> None:
        with open(path, "rb") as fh:
            self._store(fh, digest)

    def put_blob_bytes(self, data: bytes) -> str:
        digest = _sha(data)
        if not self.has_blob(digest):
            self._store(io.BytesIO(data), digest)
        return digest

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        path = self._blob_path(digest)
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise OCIError(f"{path}: blob {digest} unreadable: {exc}") from exc
        with fh:
            yield fh

    def tags(self) -> list[str]:
        names = [(d.get("annotations") or {}).get(REF_NAME) for d in self._index()["manifests"]]
        return sorted(n for n in names if n and not n.startswith("sha256-"))

    def referrers(self, digest: str) -> list[dict[str, Any]]:
        return _fallback_referrers(self, digest)

    def add_referrer(self, subject: str, descriptor: dict[str, Any]) -> None:
        _add_fallback_referrer(self, subject, descriptor)


def open_store(ref: Reference, insecure: bool = False) -> Store:
    """The store a reference names."""
    return RegistryStore(ref, insecure=insecure) if ref.scheme == "oci" else LayoutStore(ref)


# --------------------------------------------------------------------------- the OCI layout of an artifact


def artifact_manifest(root: Path, created: str | None = None) -> tuple[bytes, dict[str, Any], bytes]:
    """(manifest.json bytes, the parsed artifact manifest, the OCI manifest bytes) for an artifact folder.

    The OCI manifest is canonical JSON (sorted keys, no spaces); it depends on manifest.json and
    `created` (the publish time, an annotation) only. What a tag holds is identified by the config
    digest, the sha256 of manifest.json, which covers every payload file.
    """
    manifest = read_manifest(root)
    config = (Path(root) / MANIFEST).read_bytes()
    layers = [{"mediaType": FILE_MEDIA_TYPE, "digest": f"sha256:{e['sha256']}", "size": e["bytes"],
               "annotations": {TITLE: e["path"]}} for e in manifest["files"]]
    target = manifest.get("target") or {}
    annotations = {
        "org.opencontainers.image.title": str(manifest["name"]),
        "org.opencontainers.image.version": str(manifest["version"]),
        ANNOTATION_PREFIX + "schema-version": str(manifest.get("schema_version", "")),
    }
    if created:
        annotations["org.opencontainers.image.created"] = created
    source = manifest.get("source") or {}
    if isinstance(source, dict) and isinstance(source.get("sha256"), str):
        annotations[ANNOTATION_PREFIX + "source.sha256"] = source["sha256"]
    if isinstance(target, dict) and target:
        annotations[ANNOTATION_PREFIX + "target"] = "/".join(
            str(target[k]) for k in ("backend", "device", "dtype") if k in target)
    if manifest.get("quality") is not None:
        annotations[ANNOTATION_PREFIX + "quality"] = json.dumps(manifest["quality"], sort_keys=True)
    oci = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": _sha(config), "size": len(config)},
        "layers": layers,
        "annotations": annotations,
    }
    return config, manifest, _canonical(oci)


@dataclass
class PublishResult:
    reference: Reference
    digest: str
    uploaded: int  # blobs sent
    already: bool  # the tag already held this exact content: nothing was changed
    signed: bool


def publish(artifact: Path, ref: str | Reference, *, insecure: bool = False,
            sign_key: Path | None = None) -> PublishResult:
    """Publish a verified artifact folder; a tag is never moved to other content."""
    root = Path(artifact)
    problems = verify_artifact(root)
    if problems:
        raise ArtifactError(f"{root}: refusing to publish an artifact that fails verification:\n  "
                            + "\n  ".join(problems))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    config, manifest, oci = artifact_manifest(root, created)
    reference = ref if isinstance(ref, Reference) else parse_reference(ref)
    if reference.digest:
        raise OCIError(f"{reference}: publish to a tag, not a digest")
    if reference.tag is None:
        version = str(manifest["version"])
        if not _TAG.match(version):
            raise OCIError(f"version {version!r} is not a valid OCI tag; give REF a :TAG")
        reference = reference.with_tag(version)
    digest = _sha(oci)
    key = _load_private_key(sign_key) if sign_key else None
    store = open_store(reference, insecure)
    existing = store.get_manifest(reference.reference)
    if existing is not None:
        have = _sha(existing[0])
        try:
            their = json.loads(existing[0])["config"]["digest"]
        except (ValueError, KeyError, TypeError):
            their = "?"
        if their != _sha(config):
            raise OCIError(f"{reference} already exists with digest {have} (manifest.json {their}); this "
                           f"artifact's manifest.json is {_sha(config)}. Versions are immutable: publish "
                           "under a new version or tag")
        log.info("%s already holds %s", reference, have)
        signed = bool(key) and _attach_signature(store, existing[0], key)
        return PublishResult(reference, have, 0, True, signed)
    uploaded = 0
    for entry in manifest["files"]:
        blob = f"sha256:{entry['sha256']}"
        if not store.has_blob(blob):
            store.put_blob(root / entry["path"], blob, entry["bytes"])
            uploaded += 1
    store.put_blob_bytes(config)
    store.put_manifest(oci, OCI_MANIFEST, reference.reference)
    signed = bool(key) and _attach_signature(store, oci, key)
    return PublishResult(reference, digest, uploaded, False, signed)


# --------------------------------------------------------------------------- signatures


def _load_private_key(path: Path) -> Any:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SignatureError(f"{path}: not a readable unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{path}: not an Ed25519 private key")
    return key


def _load_public_key(path: Path) -> Any:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise SignatureError(f"{path}: not a readable PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{path}: not an Ed25519 public key")
    return key


def _key_id(public_key: Any) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _sha(raw)


def keygen(private_path: Path, public_path: Path) -> str:
    """Write a new Ed25519 key pair (PEM; the private key mode 0600); return the key id."""
    for p in (private_path, public_path):
        if Path(p).exists():
            raise SignatureError(f"{p} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub = key.public_key()
    Path(public_path).write_bytes(pub.public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return _key_id(pub)


def _attach_signature(store: Store, subject_bytes: bytes, key: Any) -> bool:
    subject = _sha(subject_bytes)
    key_id = _key_id(key.public_key())
    payload = _canonical({"subject": subject, "key_id": key_id,
                          "signature": base64.b64encode(key.sign(SIGNED_PREFIX + subject.encode())).decode()})
    blob = store.put_blob_bytes(payload)
    store.put_blob_bytes(EMPTY_BLOB)
    sig = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": SIGNATURE_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": _sha(EMPTY_BLOB), "size": len(EMPTY_BLOB)},
        "layers": [{"mediaType": SIGNATURE_MEDIA_TYPE, "digest": blob, "size": len(payload)}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": subject, "size": len(subject_bytes)},
        "annotations": {ANNOTATION_PREFIX + "key-id": key_id},
    }
    data = _canonical(sig)
    digest = _sha(data)
    store.put_manifest(data, OCI_MANIFEST, digest)
    store.add_referrer(subject, {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(data),
                                 "artifactType": SIGNATURE_TYPE, "annotations": sig["annotations"]})
    return True


def sign(ref: str | Reference, key_path: Path, *, insecure: bool = False) -> str:
    """Sign the manifest a reference names; return its digest."""
    reference = ref if isinstance(ref, Reference) else parse_reference(ref)
    store = open_store(reference, insecure)
    data, _ = _fetch_manifest(store, reference)
    _attach_signature(store, data, _load_private_key(key_path))
    return _sha(data)


def _check_signature(store: Store, reference: Reference, digest: str, public_key_path: Path) -> str:
    pub = _load_public_key(public_key_path)
    key_id = _key_id(pub)
    found = [d for d in store.referrers(digest) if d.get("artifactType") == SIGNATURE_TYPE]
    if not found:
        raise SignatureError(f"{reference} ({digest}) is not signed")
    for desc in found:
        got = store.get_manifest(desc["digest"])
        if got is None or _sha(got[0]) != desc["digest"]:
            continue
        sig = json.loads(got[0])
        if (sig.get("subject") or {}).get("digest") != digest:
            continue
        for layer in sig.get("layers") or []:
            if layer.get("mediaType") != SIGNATURE_MEDIA_TYPE or int(layer.get("size", 0)) > 65536:
                continue
            with store.open_blob(layer["digest"]) as fh:
                payload = fh.read(65537)
            if _sha(payload) != layer["digest"]:
                continue
            try:
                body = json.loads(payload)
                if body.get("subject") != digest or body.get("key_id") != key_id:
                    continue
                pub.verify(base64.b64decode(body["signature"]), SIGNED_PREFIX + digest.encode())
            except Exception:  # noqa: BLE001 - any malformed or invalid signature simply does not count
                continue
            return key_id
    raise SignatureError(f"{reference} ({digest}): no signature verifies with {public_key_path} "
                         f"(key {key_id}); {len(found)} signature(s) by other keys or invalid")


def verify_signature(ref: str | Reference, public_key_path: Path, *, insecure: bool = False) -> tuple[str, str]:
    """(manifest digest, key id) when a signature by the key covers the reference; SignatureError otherwise."""
    reference = ref if isinstance(ref, Reference) else parse_reference(ref)
    store = open_store(reference, insecure)
    data, _ = _fetch_manifest(store, reference)
    digest = _sha(data)
    return digest, _check_signature(store, reference, digest, public_key_path)


# --------------------------------------------------------------------------- pull


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/optimize`` (``~/.cache/optimize`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "optimize"


def _fetch_manifest(store: Store, reference: Reference) -> tuple[bytes, dict[str, Any]]:
    got = store.get_manifest(reference.reference)
    if got is None:
        raise OCIError(f"{reference}: not found")
    data, _ = got
    if reference.digest and _sha(data) != reference.digest:
        raise OCIError(f"{reference}: the store returned a manifest with digest {_sha(data)}")
    try:
        oci = json.loads(data)
    except ValueError as exc:
        raise OCIError(f"{reference}: manifest is not JSON: {exc}") from exc
    return data, oci


def _download(store: Store, digest: str, size: int, name: str, cache: Path) -> Path:
    """The cached blob for digest, fetched (hashed while streaming) when absent."""
    target = cache / "blobs" / "sha256" / digest.split(":", 1)[1]
    if target.is_file():  # re-hashed: a pulled folder's files are hard links to these, and may be edited
        if target.stat().st_size == size and "sha256:" + sha256_file(target) == digest:
            return target
        log.warning("%s: cached blob does not match its digest; fetching it again", target)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".part-")
    h = hashlib.sha256()
    got = 0
    try:
        with os.fdopen(fd, "wb") as out, store.open_blob(digest) as src:
            while True:
                try:
                    chunk = src.read(_CHUNK)
                except (TimeoutError, OSError, http.client.HTTPException) as exc:
                    raise OCIError(f"{name} ({digest}): transfer cut after {got} of {size} bytes: {exc}") from exc
                if not chunk:
                    break
                got += len(chunk)
                if got > size:
                    raise OCIError(f"{name} ({digest}): the store sent more than the {size} bytes listed")
                h.update(chunk)
                out.write(chunk)
        if got != size:
            raise OCIError(f"{name} ({digest}): transfer cut after {got} of {size} bytes")
        if "sha256:" + h.hexdigest() != digest:
            raise OCIError(f"{name}: content does not match its digest (expected {digest}, "
                           f"received sha256:{h.hexdigest()}); refusing it")
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def _place(blob: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(blob, dest)
    except OSError:
        shutil.copyfile(blob, dest)


@dataclass
class PullResult:
    path: Path
    digest: str
    reference: Reference
    reused: bool  # the folder was already there (verified, nothing fetched)


def pull(ref: str | Reference, output: Path | None = None, *, insecure: bool = False,
         require_signature: Path | None = None, cache: Path | None = None) -> PullResult:
    """Fetch an artifact into the cache and materialize it in `output` (default: the cache's
    ``artifacts/<digest>``), verified; refuse unsigned or wrongly signed artifacts when a key is required."""
    reference = ref if isinstance(ref, Reference) else parse_reference(ref)
    if reference.tag is None and reference.digest is None:
        raise OCIError(f"{reference}: give a :TAG or @sha256:DIGEST")
    cache = Path(cache) if cache else cache_root()
    if reference.digest and output is None and require_signature is None:
        # pinned by digest and already materialized: no registry needed (a restart while it is down)
        cached = cache / "artifacts" / reference.digest.split(":", 1)[1]
        if cached.is_dir() and not verify_artifact(cached):
            return PullResult(cached, reference.digest, reference, True)
    store = open_store(reference, insecure)
    data, oci = _fetch_manifest(store, reference)
    digest = _sha(data)
    if oci.get("artifactType") != ARTIFACT_TYPE or oci.get("mediaType", OCI_MANIFEST) != OCI_MANIFEST:
        raise OCIError(f"{reference} ({digest}) is not an optimize artifact "
                       f"(artifactType {oci.get('artifactType')!r}, expected {ARTIFACT_TYPE})")
    if require_signature is not None:
        key_id = _check_signature(store, reference, digest, require_signature)
        log.info("%s: signature by %s verified", reference, key_id)
    dest = Path(output) if output is not None else cache / "artifacts" / digest.split(":", 1)[1]
    if output is None and dest.is_dir():
        if not verify_artifact(dest):
            return PullResult(dest, digest, reference, True)
        log.warning("%s: cached artifact fails verification; fetching it again", dest)
        shutil.rmtree(dest)
    config_desc = oci.get("config") or {}
    if config_desc.get("mediaType") != CONFIG_MEDIA_TYPE:
        raise OCIError(f"{reference}: config media type {config_desc.get('mediaType')!r}, expected {CONFIG_MEDIA_TYPE}")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        # the same content already there (a restarted init container): verified and kept; else refused
        same = (dest / MANIFEST).is_file() and _sha((dest / MANIFEST).read_bytes()) == config_desc.get("digest")
        if same and not verify_artifact(dest):
            return PullResult(dest, digest, reference, True)
        raise OCIError(f"{dest} already exists and holds something else; pull into a new folder")
    layers = oci.get("layers") or []
    for layer in [config_desc, *layers]:
        if not isinstance(layer.get("digest"), str) or not _DIGEST.match(layer["digest"]) or \
                not isinstance(layer.get("size"), int):
            raise OCIError(f"{reference}: malformed descriptor {layer!r}")
    config_blob = _download(store, config_desc["digest"], config_desc["size"], MANIFEST, cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.pull-"))
    try:
        shutil.copyfile(config_blob, work / MANIFEST)
        manifest = read_manifest(work)
        listed = {e["path"]: e for e in manifest["files"]}
        titles = {(d.get("annotations") or {}).get(TITLE): d for d in layers}
        if set(titles) != set(listed):
            raise OCIError(f"{reference}: the OCI layers ({len(titles)}) do not match the files of "
                           f"{MANIFEST} ({len(listed)}): {sorted(set(titles) ^ set(listed))[:5]}")
        for rel, entry in listed.items():
            desc = titles[rel]
            if desc["digest"] != f"sha256:{entry['sha256']}" or desc["size"] != entry["bytes"]:
                raise OCIError(f"{reference}: layer {rel} ({desc['digest']}) disagrees with {MANIFEST}")
        for rel, entry in listed.items():
            blob = _download(store, f"sha256:{entry['sha256']}", entry["bytes"], rel, cache)
            _place(blob, work / rel)
        problems = verify_artifact(work)
        if problems:
            raise OCIError(f"{reference}: pulled artifact fails verification:\n  " + "\n  ".join(problems))
        if dest.is_dir():
            dest.rmdir()
        os.rename(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("pulled %s (%s) into %s", reference, digest, dest)
    return PullResult(dest, digest, reference, False)


def resolve_artifact(artifact: str | os.PathLike[str], *, insecure: bool = False,
                     require_signature: Path | None = None) -> Path:
    """A local artifact folder for a path or a reference (pulled, or reused from the cache, and verified).

    With `require_signature`, a reference must carry a signature by that key; a local folder is refused
    (it carries no signature to check).
    """
    if is_reference(artifact):
        return pull(str(artifact), insecure=insecure, require_signature=require_signature).path
    if require_signature is not None:
        raise SignatureError(f"{artifact}: a signature can only be required of an oci:// or file:// reference; "
                             "a local folder carries none")
    return Path(artifact)
