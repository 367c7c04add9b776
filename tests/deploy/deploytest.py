"""Helpers for the deploy/ tests: render kustomizations, find objects, read kvproxy.yaml.

Renders with `kubectl kustomize` (or a standalone `kustomize build`), fully offline; no
cluster is needed. Also holds the structural schemas for the Prometheus Operator objects,
whose CRD schemas kubernetes-validate does not bundle.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES_VERSION = "1.33.0"
RENDER_TIMEOUT_S = 60

Obj = dict[str, Any]


# Overlays that are not a router's sidecar: kvproxy alone in its Pod, in front of router
# Services (test_deploy_gateway.py holds them to their own properties).
GATEWAY_OVERLAYS = ("gateway",)


def overlays() -> list[str]:
    """Every sidecar overlay (kvproxy beside a router in one Pod), found on disk so that a
    new one is tested automatically; the gateway overlays are GATEWAY_OVERLAYS."""
    found = (p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
    return sorted(name for name in found if name not in GATEWAY_OVERLAYS)


def kustomizations() -> list[str]:
    """Every Kustomization (not Component) under deploy/, relative to it."""
    found = []
    for path in sorted(DEPLOY.rglob("kustomization.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if doc.get("kind", "Kustomization") == "Kustomization":
            found.append(str(path.parent.relative_to(DEPLOY)))
    return found


def kustomize_command() -> list[str]:
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    pytest.skip("neither kubectl nor kustomize is installed (.ci/run installs kubectl)")


def render_dir(path: Path) -> list[Obj]:
    proc = subprocess.run(
        [*kustomize_command(), str(path)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"kustomize {path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@functools.cache
def _render_cached(rel: str) -> tuple[Obj, ...]:
    return tuple(render_dir(DEPLOY / rel))


def render(rel: str) -> list[Obj]:
    """Rendered objects of deploy/<rel>; a fresh deep copy each call (tests may mutate)."""
    return yaml.safe_load(yaml.safe_dump(list(_render_cached(rel))))  # type: ignore[no-any-return]


def render_with_components(tmp: Path, resource: str, components: list[str]) -> list[Obj]:
    """Render deploy/<resource> plus extra components, the way an operator's overlay would."""
    rel = Path(os.path.relpath(DEPLOY, tmp))
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(rel / resource)],
        "components": [str(rel / c) for c in components],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return render_dir(tmp)


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    hits = find(objs, kind, name)
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def pod_spec(obj: Obj) -> Obj:
    spec: Obj = obj["spec"]["template"]["spec"]
    return spec


def container(spec: Obj, name: str) -> Obj:
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        if c["name"] == name:
            return c  # type: ignore[no-any-return]
    raise AssertionError(f"no container {name!r}")


def all_containers(spec: Obj) -> Iterator[Obj]:
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def mounted_config(objs: list[Obj], spec: Obj) -> Obj:
    """kvproxy.yaml as parsed YAML, from the ConfigMap the Pod spec actually mounts."""
    names = [
        v["configMap"]["name"]
        for v in spec.get("volumes", [])
        if "configMap" in v and v["configMap"]["name"].startswith("kvproxy-config")
    ]
    assert len(names) == 1, f"expected one kvproxy-config volume, found {names}"
    cm = one(objs, "ConfigMap", names[0])
    doc: Obj = yaml.safe_load(cm["data"]["kvproxy.yaml"])
    return doc


def resolve_port(c: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    for p in c.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"container {c['name']} has no port named {port!r}")


def container_argv(c: Obj) -> list[str]:
    """What a container runs, with Kubernetes' $(VAR) expansion from its own env."""
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    argv = [*c.get("command", []), *c.get("args", [])]
    return [env.get(a[2:-1], a) if a.startswith("$(") and a.endswith(")") else a for a in argv]


def exposure_problems(objs: list[Obj], dep: Obj, public_port: int, admin_port: int) -> list[str]:
    """Services selecting kvproxy's Pods expose its public port, or its admin port on a
    Service of its own (the gate's `kvproxy-admin`; who may reach it is the
    NetworkPolicy's business): never the router, never the admin port beside the clients'."""
    kv = container(pod_spec(dep), "kvproxy")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    out = []
    for svc in find(objs, "Service"):
        if not svc["spec"].get("selector", {}).items() <= pod_labels.items():
            continue
        targets = [resolve_port(kv, p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]]
        allowed = {public_port} if public_port in targets else {admin_port}
        out += [
            f"Service {svc['metadata']['name']} exposes port {target}"
            for target in targets
            if target not in allowed
        ]
    return out


def gate_reach_problems(app: list[Obj], gate: list[Obj]) -> list[str]:
    """The release gate Job can reach what its flags name: `--proxy` is a Service on kvproxy's
    public port, `--proxy-admin` one on its admin port, and some NetworkPolicy selecting
    kvproxy's Pods admits the Job's Pods (same namespace) to the admin port. Without the
    last, the gate's limit and deferral checks would find the port closed."""
    dep = one(app, "Deployment", "kvproxy")
    spec = pod_spec(dep)
    cfg = mounted_config(app, spec)
    kv = container(spec, "kvproxy")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    job = one(gate, "Job", "kvproxy-check")
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    argv = container_argv(container(pod_spec(job), "check"))

    def port_of(listen: str) -> int:
        return int(listen.rpartition(":")[2])

    public = port_of(cfg.get("listen", "0.0.0.0:8080"))
    admin = port_of(cfg.get("admin_listen", "0.0.0.0:9090"))
    out = []
    for flag_name, want in (("--proxy", public), ("--proxy-admin", admin)):
        if flag_name not in argv:
            out.append(f"the gate has no {flag_name}")
            continue
        url = urlsplit(argv[argv.index(flag_name) + 1])
        services = [
            s
            for s in find(app, "Service", url.hostname)
            if s["spec"].get("selector", {}).items() <= pod_labels.items()
        ]
        ports = {
            resolve_port(kv, p.get("targetPort", p["port"]))
            for s in services
            for p in s["spec"]["ports"]
            if p["port"] == url.port
        }
        if ports != {want}:
            out.append(f"the gate's {flag_name} {url.geturl()} is no Service on port {want}")
    admitted = False
    for policy in find(app, "NetworkPolicy"):
        if not policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items():
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = {resolve_port(kv, p["port"]) for p in rule.get("ports", [])}
            if ports and admin not in ports:
                continue
            for peer in rule.get("from", [{}]):
                same_ns = "namespaceSelector" not in peer
                selector = peer.get("podSelector", {}).get("matchLabels", {})
                if same_ns and "ipBlock" not in peer and selector.items() <= job_labels.items():
                    admitted = True
    if not admitted:
        out.append("no NetworkPolicy admits the gate Job to the admin port")
    return out


# --- Prometheus Operator objects: structure checked here, CRDs are not bundled -------------

_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}, "labels": _LABELS},
}
_SELECTOR = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": False,
    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"type": "string"},
    },
}
_POD_METRICS_ENDPOINT_FIELDS = [
    *("port", "portNumber", "targetPort", "path", "scheme", "params", "interval"),
    *("scrapeTimeout", "honorLabels", "honorTimestamps", "trackTimestampsStaleness"),
    *("metricRelabelings", "relabelings", "filterRunning", "followRedirects", "enableHttp2"),
    *("proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader", "basicAuth"),
    *("authorization", "oauth2", "tlsConfig", "bearerTokenSecret"),
]

PODMONITOR_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer", "minimum": 0},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            **{f: {} for f in _POD_METRICS_ENDPOINT_FIELDS},
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                        },
                    },
                },
            },
            "additionalProperties": False,
        },
    },
}

_RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "properties": {
        "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*$"},
        "expr": {"type": ["string", "integer"], "minLength": 1},
        "for": {"type": "string", "pattern": _DURATION},
        "keep_firing_for": {"type": "string", "pattern": _DURATION},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "oneOf": [
        {"required": ["alert"], "not": {"required": ["record"]}},
        {"required": ["record"], "not": {"required": ["alert"]}},
    ],
}

PROMETHEUSRULE_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "query_offset": {"type": "string", "pattern": _DURATION},
                            "limit": {"type": "integer", "minimum": 0},
                            "labels": _LABELS,
                            "partial_response_strategy": {"type": "string"},
                            "rules": {"type": "array", "minItems": 1, "items": _RULE},
                        },
                    },
                }
            },
        },
    },
}

CRD_SCHEMAS: dict[tuple[str, str], Obj] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUSRULE_SCHEMA,
}
