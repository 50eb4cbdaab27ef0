"""deploy/ agrees with the server (port, probe paths, read-only artifact, limits, drain time, KV-event
ports), the router's manifest finds the server pods and may do so, and every manifest in deploy/
validates against the Kubernetes API schemas (kubernetes-validate, offline)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from runtime import server
from runtime.kv_events import parse_endpoint

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
    kv = _flag(args, "--kv-events")
    assert kv is not None
    pub, replay = parse_endpoint(kv)
    assert ports == {"http": port, "kv-events": int(pub.rsplit(":", 1)[1]), "kv-replay": int(replay.rsplit(":", 1)[1])}

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


ROUTER = ROOT / "deploy" / "router.yaml"
# Kubernetes minor versions the manifests must be valid for (the schemas ship with kubernetes-validate).
K8S_VERSIONS = ("1.30", "1.33")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_api_schemas(version: str) -> None:
    """Strict: an unknown or misspelt field fails, as does a wrong type; no cluster needed."""
    files = sorted((ROOT / "deploy").glob("*.yaml"))
    assert {f.name for f in files} >= {"kubernetes.yaml", "canary.yaml", "router.yaml"}
    count = 0
    for f in files:
        for doc in yaml.safe_load_all(f.read_text(encoding="utf-8")):
            if doc:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{f.name}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at "
                                f"{'.'.join(map(str, exc.path))}")
                count += 1
    assert count >= 9


def test_the_validator_catches_a_typo(docs: dict[str, dict[str, Any]]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(docs["Deployment"]))
    _container(broken)["ports"][0]["containerPortt"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError, match="containerPortt"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_router_discovers_the_server_pods_with_the_rbac_it_needs(docs: dict[str, dict[str, Any]]) -> None:
    router = {d["kind"]: d for d in yaml.safe_load_all(ROUTER.read_text(encoding="utf-8")) if d}
    assert set(router) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "NetworkPolicy"}
    pod = router["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert c["command"] == ["vllm-router"] and "--service-discovery" in args
    sel_at = args.index("--selector") + 1
    selector = dict(a.split("=", 1) for a in args[sel_at:] if not a.startswith("--") and "=" in a)
    server_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= server_labels.items()  # it finds the serve pods (stable and canary)
    assert not {"optimize.dev/track"} & set(selector)
    assert int(_flag(args, "--service-discovery-port") or 0) == server.DEFAULT_PORT
    assert _flag(args, "--health-check-endpoint") == server.HEALTH_PATH
    assert _flag(args, "--service-discovery-namespace") == "$(POD_NAMESPACE)"
    # RBAC: its ServiceAccount may get, list and watch pods in its namespace, nothing more
    assert pod["serviceAccountName"] == router["ServiceAccount"]["metadata"]["name"]
    binding = router["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": router["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert router["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    svc = router["Service"]["spec"]
    assert svc["selector"].items() <= router["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    # the KV-event ports of the serve pods admit the router's pods only; the API port stays open
    policy = router["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= server_labels.items()
    open_rule, router_rule = policy["ingress"]
    assert "from" not in open_rule and [p["port"] for p in open_rule["ports"]] == ["http"]
    (peer,) = router_rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= router["Deployment"]["spec"]["template"]["metadata"][
        "labels"].items()
    assert sorted(p["port"] for p in router_rule["ports"]) == ["kv-events", "kv-replay"]
    named = {p["name"] for p in _container(docs["Deployment"])["ports"]}
    assert {"http", "kv-events", "kv-replay"} <= named
