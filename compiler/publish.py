"""`optimize list` and `optimize diff`: what a repository holds, and how two artifacts differ.

`list` reads only OCI manifests (their annotations: name, version, created, target, quality), never
blobs. `diff` compares two artifacts, each a folder or a reference (pulled into the cache and
verified): recipe and pass changes, kernels chosen, quantization statistics, quality numbers side by
side, and files added, removed or changed with their sizes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from runtime.artifact import ArtifactError, read_manifest
from runtime.oci import ARTIFACT_TYPE, is_reference, open_store, parse_reference, resolve_artifact

__all__ = ["diff_artifacts", "format_diff", "format_list", "list_tags"]

_QUALITY_KEYS = ("perplexity", "perplexity_increase_pct", "kl_divergence", "decode_kl_divergence",
                 "token_agreement", "mean_nll")


def list_tags(repo: str, insecure: bool = False) -> list[dict[str, Any]]:
    """One row per tag holding an optimize artifact (other manifests are skipped)."""
    ref = parse_reference(repo)
    if ref.tag or ref.digest:
        raise ArtifactError(f"{repo}: list takes a repository (no :TAG or @DIGEST)")
    store = open_store(ref, insecure)
    rows = []
    for tag in store.tags():
        got = store.get_manifest(tag)
        if got is None:
            continue
        try:
            oci = json.loads(got[0])
        except ValueError:
            continue
        if oci.get("artifactType") != ARTIFACT_TYPE:
            continue
        ann = oci.get("annotations") or {}
        quality = json.loads(ann.get("dev.optimize.quality", "null"))
        metrics = (quality or {}).get("metrics") or {}
        rows.append({
            "tag": tag,
            "digest": "sha256:" + hashlib.sha256(got[0]).hexdigest(),
            # sha256 of manifest.json: what /v1/models and /metrics of a replica serving it name
            "manifest_sha256": str((oci.get("config") or {}).get("digest", "")).removeprefix("sha256:"),
            "name": ann.get("org.opencontainers.image.title"),
            "version": ann.get("org.opencontainers.image.version"),
            "created": ann.get("org.opencontainers.image.created"),
            "target": ann.get("dev.optimize.target"),
            "bytes": sum(int(layer.get("size", 0)) for layer in oci.get("layers") or []),
            "quality_passed": (quality or {}).get("passed"),
            "perplexity": metrics.get("perplexity"),
            "perplexity_increase_pct": metrics.get("perplexity_increase_pct"),
        })
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def format_list(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no artifacts)"
    body = [[r["tag"], r["name"] or "-", r["version"] or "-", r["created"] or "-", r["target"] or "-",
             _mib(r["bytes"]), _num(r["perplexity"]), _num(r["perplexity_increase_pct"]), r["digest"][:19]]
            for r in rows]
    return _table(["TAG", "NAME", "VERSION", "CREATED", "TARGET", "SIZE", "PPL", "PPL +%", "DIGEST"], body)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _changes(a: Any, b: Any) -> list[dict[str, Any]]:
    fa, fb = _flatten(a or {}), _flatten(b or {})
    return [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(fa.keys() | fb.keys())
            if fa.get(k) != fb.get(k)]


def _load(arg: str, insecure: bool) -> tuple[str, Path, dict[str, Any]]:
    folder = resolve_artifact(arg, insecure=insecure) if is_reference(arg) else Path(arg)
    return arg, folder, read_manifest(folder)


def diff_artifacts(a: str, b: str, insecure: bool = False) -> dict[str, Any]:
    """The differences between two artifacts, as plain JSON data."""
    (name_a, _, ma), (name_b, _, mb) = _load(a, insecure), _load(b, insecure)
    passes_a = [p.get("name") for p in ma.get("passes") or []]
    passes_b = [p.get("name") for p in mb.get("passes") or []]
    by_a = {p.get("name"): p for p in ma.get("passes") or []}
    by_b = {p.get("name"): p for p in mb.get("passes") or []}
    pass_changes = []
    for name in dict.fromkeys([*passes_a, *passes_b]):
        pa, pb = by_a.get(name), by_b.get(name)
        if pa is None or pb is None:
            pass_changes.append({"pass": name, "change": "added" if pa is None else "removed",
                                 "config": (pb or pa or {}).get("config"), "stats": (pb or pa or {}).get("stats")})
            continue
        config = _changes(pa.get("config"), pb.get("config"))
        if config or pa.get("status") != pb.get("status"):
            pass_changes.append({"pass": name, "change": "changed", "config": config,
                                 "status": [pa.get("status"), pb.get("status")]})
    quant = {name: (by_b.get(name) or by_a.get(name) or {}).get("stats")
             for name in dict.fromkeys([*passes_a, *passes_b])
             if name and (name.startswith("quantize") or name.startswith("lower_quant"))}
    qa = ((ma.get("quality") or {}).get("metrics")) or {}
    qb = ((mb.get("quality") or {}).get("metrics")) or {}
    quality = []
    for key in _QUALITY_KEYS:
        if key in qa or key in qb:
            va, vb = qa.get(key), qb.get(key)
            delta = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
            quality.append({"metric": key, "a": va, "b": vb, "delta": delta})
    fa = {f["path"]: f for f in ma["files"]}
    fb = {f["path"]: f for f in mb["files"]}
    files = []
    for path in sorted(fa.keys() | fb.keys()):
        ea, eb = fa.get(path), fb.get(path)
        if ea is None:
            files.append({"path": path, "change": "added", "a_bytes": None, "b_bytes": eb["bytes"]})  # type: ignore[index]
        elif eb is None:
            files.append({"path": path, "change": "removed", "a_bytes": ea["bytes"], "b_bytes": None})
        elif ea["sha256"] != eb["sha256"]:
            files.append({"path": path, "change": "changed", "a_bytes": ea["bytes"], "b_bytes": eb["bytes"]})
    size_a, size_b = sum(f["bytes"] for f in ma["files"]), sum(f["bytes"] for f in mb["files"])
    return {
        "a": {"ref": name_a, "name": ma["name"], "version": ma["version"], "target": ma.get("target"),
              "bytes": size_a, "passes": passes_a},
        "b": {"ref": name_b, "name": mb["name"], "version": mb["version"], "target": mb.get("target"),
              "bytes": size_b, "passes": passes_b},
        "recipe": _changes(ma.get("recipe"), mb.get("recipe")),
        "passes": pass_changes,
        "kernels": _changes(ma.get("kernels"), mb.get("kernels")),
        "quantization": quant,
        "quality": quality,
        "files": files,
        "size": {"a": size_a, "b": size_b, "delta": size_b - size_a,
                 "ratio": round(size_b / size_a, 4) if size_a else None},
    }


def _short(v: Any, limit: int = 60) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_diff(d: dict[str, Any]) -> str:
    a, b = d["a"], d["b"]
    out = [f"A: {a['ref']}  ({a['name']} {a['version']})", f"B: {b['ref']}  ({b['name']} {b['version']})", ""]
    out.append("passes")
    out.append(f"  A: {' -> '.join(a['passes'])}")
    out.append(f"  B: {' -> '.join(b['passes'])}")
    for p in d["passes"]:
        if p["change"] == "changed":
            detail = ", ".join(f"{c['key']}: {_short(c['a'], 20)} -> {_short(c['b'], 20)}" for c in p["config"])
            out.append(f"  ~ {p['pass']}: {detail or 'status ' + ' -> '.join(map(str, p['status']))}")
        else:
            sign = "+" if p["change"] == "added" else "-"
            out.append(f"  {sign} {p['pass']} {_short(p['config'] or {})}")
    for title, key in (("recipe", "recipe"), ("kernels", "kernels")):
        out += ["", title]
        rows = [[c["key"], _short(c["a"]), _short(c["b"])] for c in d[key]]
        out += ["  " + line for line in _table(["KEY", "A", "B"], rows).splitlines()] if rows else ["  (same)"]
    out += ["", "quantization"]
    if d["quantization"]:
        for name, stats in d["quantization"].items():
            out.append(f"  {name}: {_short(stats, 200)}")
    else:
        out.append("  (none)")
    out += ["", "quality"]
    rows = [[q["metric"], _num(q["a"]), _num(q["b"]), _num(q["delta"])] for q in d["quality"]]
    out += ["  " + line for line in _table(["METRIC", "A", "B", "DELTA"], rows).splitlines()] if rows \
        else ["  (not evaluated)"]
    out += ["", "files"]
    rows = [[f["change"], f["path"], "-" if f["a_bytes"] is None else str(f["a_bytes"]),
             "-" if f["b_bytes"] is None else str(f["b_bytes"])] for f in d["files"]]
    out += ["  " + line for line in _table(["CHANGE", "PATH", "A BYTES", "B BYTES"], rows).splitlines()] if rows \
        else ["  (identical)"]
    s = d["size"]
    ratio = f", x{s['ratio']}" if s["ratio"] is not None else ""
    out += ["", f"size: {_mib(s['a'])} -> {_mib(s['b'])} ({s['delta']:+d} bytes{ratio})"]
    return "\n".join(out)
