"""deploy/kubernetes.yaml agrees with the server: port, probe paths, read-only artifact, limits, drain time."""

from __future__ import annotations

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
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"] == svc["selector"]
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
    assert vols[mount["name"]]["persistentVolumeClaim"]["readOnly"] is True
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind])
    grace = float(_flag(c["args"], "--shutdown-grace") or server.DEFAULT_SHUTDOWN_GRACE)
    assert pod["terminationGracePeriodSeconds"] > grace  # the drain finishes before the kubelet kills
    assert deploy["spec"]["replicas"] >= 2
