"""deploy/kubernetes.yaml agrees with the server: port, probe paths, read-only artifact, limits, drain time."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime import server

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    loaded = [d for d in yaml.safe_load_all(MANIFEST.read_text(encoding="utf-8")) if d]
    by_kind = {d["kind"]: d for d in loaded}
    assert set(by_kind) == {"Deployment", "Service"}
    return by_kind


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def _container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_probes_and_ports_match_the_server(docs: dict[str, dict[str, Any]]) -> None:
    c = _container(docs["Deployment"])
    args = c["args"]
    assert args[0] == "serve" and args[1].startswith("/artifacts/")
    port = int(_flag(args, "--port") or server.DEFAULT_PORT)
    assert port == server.DEFAULT_PORT
    assert _flag(args, "--host") == "0.0.0.0"  # reachable from the Service, not only loopback
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": port}

    def target(probe: dict[str, Any]) -> tuple[str, int]:
        get = probe["httpGet"]
        return get["path"], ports[get["port"]] if isinstance(get["port"], str) else get["port"]

    assert target(c["readinessProbe"]) == (server.READY_PATH, port)
    assert target(c["livenessProbe"]) == (server.HEALTH_PATH, port)
    assert target(c["startupProbe"]) == (server.READY_PATH, port)

    svc = docs["Service"]["spec"]
    assert svc["selector"].items() <= docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    assert svc["selector"].items() <= docs["Deployment"]["spec"]["selector"]["matchLabels"].items()
    (sp,) = svc["ports"]
    assert sp["targetPort"] in ("http", port)


def test_artifact_read_only_limits_and_drain_time(docs: dict[str, dict[str, Any]]) -> None:
    deploy = docs["Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    c = _container(deploy)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    artifact_path = c["args"][1]
    (mount,) = [m for m in mounts.values() if artifact_path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount["readOnly"] is True
    assert "emptyDir" in vols[mount["name"]]  # filled by the init container's verified pull, pod-local
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind])
    grace = float(_flag(c["args"], "--shutdown-grace") or server.DEFAULT_SHUTDOWN_GRACE)
    assert pod["terminationGracePeriodSeconds"] > grace  # the drain finishes before the kubelet kills
    assert deploy["spec"]["replicas"] >= 2


CANARY = ROOT / "deploy" / "canary.yaml"


def _pull(deploy: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from runtime.oci import parse_reference

    (init,) = deploy["spec"]["template"]["spec"]["initContainers"]
    args = init["args"]
    assert args[0] == "pull"
    return init, parse_reference(args[1])


def test_pull_by_digest_signed_before_the_server_starts(docs: dict[str, dict[str, Any]]) -> None:
    deploy = docs["Deployment"]
    init, ref = _pull(deploy)
    assert ref.scheme == "oci" and ref.digest and re.fullmatch(r"sha256:[0-9a-f]{64}", ref.digest)
    args = init["args"]
    out = _flag(args, "-o")
    assert out == _container(deploy)["args"][1]  # the server serves what the init container verified
    key = _flag(args, "--require-signature")
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert key and any(key.startswith(p + "/") and m["readOnly"] for p, m in mounts.items())
    artifacts = next(m for p, m in mounts.items() if out.startswith(p + "/"))
    cache = next(e["value"] for e in init["env"] if e["name"] == "XDG_CACHE_HOME")
    assert cache.startswith(next(p for p, m in mounts.items() if m is artifacts) + "/")  # hard links: same volume
    assert not artifacts.get("readOnly")


def test_canary_beside_stable_and_rollback(docs: dict[str, dict[str, Any]]) -> None:
    (canary,) = [d for d in yaml.safe_load_all(CANARY.read_text(encoding="utf-8")) if d]
    stable = docs["Deployment"]
    assert canary["kind"] == "Deployment" and canary["metadata"]["name"] != stable["metadata"]["name"]
    svc = docs["Service"]["spec"]["selector"]
    sel_s, sel_c = stable["spec"]["selector"]["matchLabels"], canary["spec"]["selector"]["matchLabels"]
    labels_s = stable["spec"]["template"]["metadata"]["labels"]
    labels_c = canary["spec"]["template"]["metadata"]["labels"]
    assert svc.items() <= labels_s.items() and svc.items() <= labels_c.items()  # one Service, both tracks
    assert sel_s.items() <= labels_s.items() and sel_c.items() <= labels_c.items()
    assert not sel_s.items() <= labels_c.items() and not sel_c.items() <= labels_s.items()  # no overlap
    assert 0 < canary["spec"]["replicas"] < stable["spec"]["replicas"]  # a slice of the traffic
    (_, ref_s), (_, ref_c) = _pull(stable), _pull(canary)
    assert (ref_s.host, ref_s.repo) == (ref_c.host, ref_c.repo) and ref_s.digest != ref_c.digest
    assert ref_c.digest and re.fullmatch(r"sha256:[0-9a-f]{64}", ref_c.digest)
    c_s, c_c = _container(stable), _container(canary)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c_c[probe] == c_s[probe]
    assert c_c["args"] == c_s["args"] and c_c["resources"] == c_s["resources"]
    assert _flag(_pull(canary)[0]["args"], "--require-signature") == _flag(_pull(stable)[0]["args"],
                                                                          "--require-signature")
    assert canary["spec"]["template"]["metadata"]["annotations"] == stable["spec"]["template"]["metadata"]["annotations"]
    text = CANARY.read_text(encoding="utf-8")
    assert "kubectl delete -f deploy/canary.yaml" in text and "rollout undo" in text
