"""The gateway overlay (deploy/overlays/gateway): kvproxy alone in its Pod in front of several
PD clusters' router Services. Its safety properties are read from the rendered YAML, as the
sidecar overlays' are (test_deploy_safety.py, whose shared checks apply here unchanged);
what differs is checked here: no router in the Pod, kvproxy's own stop is the drain, each
cluster is a router Service with engines of its own, and the HPA's metric is one kvproxy
exports and the documented prometheus-adapter rule serves. Each check is also shown to
catch a broken copy, so none passes vacuously.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploytest import (
    DEPLOY,
    GATEWAY_OVERLAYS,
    Obj,
    all_containers,
    container,
    container_argv,
    exposure_problems,
    find,
    gate_reach_problems,
    mounted_config,
    one,
    pod_spec,
    render,
    resolve_port,
)
from test_deploy_render import validate
from test_deploy_safety import (
    deployment,
    problems_network_policy,
    problems_probes,
    problems_rollout,
    problems_security,
    set_config,
    setting,
)

from kvproxy.config import load_settings, split_host_port
from kvproxy.observe.metrics import Metrics

OVERLAY = "overlays/gateway"
EXAMPLES = DEPLOY / "overlays/gateway/router-services.example.yaml"
ADAPTER = DEPLOY / "overlays/gateway/prometheus-adapter-values.yaml"
# Seconds kvproxy needs after shutdown_grace_s to close its sites, pools and sessions
# (kvproxy.serve.app: the final cleanup wait) and exit.
EXIT_S = 20


def example_services() -> dict[str, set[int]]:
    docs = yaml.safe_load_all(EXAMPLES.read_text(encoding="utf-8"))
    return {d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]} for d in docs if d}


def host_port(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port


# --- the properties ------------------------------------------------------------------------


def problems_shape(objs: list[Obj]) -> list[str]:
    spec = pod_spec(deployment(objs))
    names = [c["name"] for c in spec.get("containers", [])]
    out = []
    if names != ["kvproxy"]:
        out.append(f"the Pod's containers are {names}, not kvproxy alone")
    if spec.get("initContainers"):
        out.append("the Pod has init containers (no router shares a gateway's Pod)")
    if "replicas" in deployment(objs)["spec"]:
        out.append("the Deployment pins replicas that the HPA owns")
    return out


def problems_grace(objs: list[Obj]) -> list[str]:
    """kvproxy's own stop is the drain: it waits shutdown_grace_s for in-flight requests and
    deferred cancellations, which must cover drain_timeout_s, inside the grace period."""
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    drain_s = float(setting(cfg, "drain_timeout_s"))
    shutdown_s = float(setting(cfg, "shutdown_grace_s"))
    grace_s = float(spec.get("terminationGracePeriodSeconds", 30))
    sleep = container(spec, "kvproxy").get("lifecycle", {}).get("preStop", {}).get("sleep")
    out = []
    if sleep is None:
        out.append("kvproxy has no preStop sleep: it stops accepting before endpoints update")
        delay_s = 0.0
    else:
        delay_s = float(sleep["seconds"])
        if delay_s < 5:
            out.append(f"preStop sleep {delay_s:g} s is too short for endpoints to update")
    if shutdown_s < drain_s:
        out.append(
            f"shutdown_grace_s {shutdown_s:g} < drain_timeout_s {drain_s:g}: a deferral "
            "started before SIGTERM would end as `shutdown`, not at a safe point"
        )
    if grace_s < delay_s + shutdown_s + EXIT_S:
        out.append(
            f"terminationGracePeriodSeconds {grace_s:g} < preStop {delay_s:g} + "
            f"shutdown_grace_s {shutdown_s:g} + {EXIT_S} s to exit"
        )
    return out


def problems_exposure(objs: list[Obj]) -> list[str]:
    dep = deployment(objs)
    spec = pod_spec(dep)
    cfg = mounted_config(objs, spec)
    public_port = split_host_port(setting(cfg, "listen"))[1]
    admin_port = split_host_port(setting(cfg, "admin_listen"))[1]
    out = []
    if spec.get("hostNetwork") or any(
        p.get("hostPort") for c in all_containers(spec) for p in c.get("ports", [])
    ):
        out.append("the Pod uses the host network or host ports")
    return out + exposure_problems(objs, dep, public_port, admin_port)


def problems_clusters(objs: list[Obj]) -> list[str]:
    """Several clusters, each a router Service of the example with engines of its own that
    kvproxy measures: an engine shared by two clusters would be one pool counted twice."""
    cfg = mounted_config(objs, pod_spec(deployment(objs)))
    services = example_services()
    clusters = cfg.get("upstreams") or []
    out = []
    if len(clusters) < 2:
        out.append(f"the gateway lists {len(clusters)} cluster(s), not several")
    if "engines" in cfg or "upstream" in cfg:
        out.append("top-level engines/upstream next to upstreams")
    owner: dict[tuple[str, int | None], str] = {}
    for cluster in clusters:
        name = cluster["name"]
        host, port = host_port(cluster["url"])
        if port not in services.get(host, set()):
            out.append(f"cluster {name}'s router {host}:{port} is not an example Service")
        roles = set()
        for engine in cluster["engines"]:
            where = host_port(engine["url"])
            roles.add(engine["role"])
            if where[1] not in services.get(where[0], set()):
                out.append(f"cluster {name}'s engine {where[0]}:{where[1]} has no Service")
            if where in owner:
                out.append(f"engine {where[0]}:{where[1]} is in {owner[where]} and {name}")
            owner[where] = name
            if where == (host, port):
                out.append(f"cluster {name} measures its router as an engine")
        if not {"prefill", "decode"} <= roles:
            out.append(f"cluster {name} lacks a prefill or decode engine ({sorted(roles)})")
    return out


def problems_hpa(objs: list[Obj]) -> list[str]:
    """The HPA scales this Deployment on a metric kvproxy exports, served under the name the
    HPA asks for by the documented prometheus-adapter rule."""
    out = []
    hpa = one(objs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    if not find(objs, target["kind"], target["name"]):
        out.append(f"the HPA scales {target['kind']}/{target['name']}, which is not rendered")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    families = list(Metrics().registry.collect())
    exported = {fam.name for fam in families} | {s.name for f in families for s in f.samples}
    if metric not in exported:
        out.append(f"the HPA's metric {metric} is not one kvproxy exports")
    rules = yaml.safe_load(ADAPTER.read_text(encoding="utf-8"))["rules"]["custom"]
    served = [r for r in rules if r.get("name", {}).get("as") == metric]
    if len(served) != 1:
        out.append(f"prometheus-adapter-values.yaml serves {metric} {len(served)} times")
    else:
        series = served[0]["seriesQuery"]
        if not series.startswith(metric + "{") or 'pod!=""' not in series:
            out.append(f"the adapter rule reads {series}, not {metric} per Pod")
        if set(served[0]["resources"]["overrides"]) != {"namespace", "pod"}:
            out.append("the adapter rule does not map namespace and pod")
    return out


CHECKS = (
    problems_shape,
    problems_grace,
    problems_exposure,
    problems_clusters,
    problems_hpa,
    problems_probes,
    problems_rollout,
    problems_network_policy,
)


# --- the shipped overlay has none of these problems ----------------------------------------


def test_gateway_overlay_is_listed_apart_from_the_sidecars() -> None:
    assert GATEWAY_OVERLAYS == ("gateway",)
    for obj in render(OVERLAY):
        validate(obj)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_gateway_overlay_is_safe(check: Any) -> None:
    assert check(render(OVERLAY)) == []


@pytest.mark.parametrize("rel", [OVERLAY, f"{OVERLAY}/release-gate"])
def test_gateway_security_context(rel: str) -> None:
    workloads = [*find(render(rel), "Deployment"), *find(render(rel), "Job")]
    assert workloads
    for workload in workloads:
        assert problems_security(pod_spec(workload)) == []


def test_gateway_config_loads_as_one_model_on_several_clusters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(OVERLAY)
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    path = tmp_path / "kvproxy.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    for key in list(os.environ):
        if key.upper().startswith("KVPROXY_"):
            monkeypatch.delenv(key)
    kv = container(spec, "kvproxy")
    env = {e["name"]: e.get("value") for e in kv.get("env", [])}
    mount = next(m for m in kv["volumeMounts"] if m["name"] == "kvproxy-config")
    assert env["KVPROXY_CONFIG"] == f"{mount['mountPath']}/kvproxy.yaml"
    assert mount["readOnly"] is True
    monkeypatch.setenv("KVPROXY_CONFIG", str(path))
    settings = load_settings()  # kvproxy's own validating loader, as the Pod runs it
    [model] = settings.model_table()
    clusters = settings.clusters(model)
    assert [c.name for c in clusters] == [c["name"] for c in cfg["upstreams"]]
    assert len(clusters) >= 2
    for cluster in clusters:
        own = settings.for_cluster(model, cluster)
        assert own.engines == cluster.engines  # measured on its own engines
        assert own.upstream == cluster.url
    assert settings.max_context is not None
    assert settings.affinity_for(model) == "X-Session-ID"
    assert resolve_port(kv, "http") == settings.listen_host_port[1]
    assert resolve_port(kv, "admin") == settings.admin_host_port[1]


# --- the checks catch what they claim to catch ---------------------------------------------


def test_checks_catch_a_router_in_the_pod_and_pinned_replicas() -> None:
    objs = render(OVERLAY)
    spec = pod_spec(deployment(objs))
    spec["containers"].append({"name": "router", "image": "x"})
    deployment(objs)["spec"]["replicas"] = 2
    found = problems_shape(objs)
    assert "the Pod's containers are ['kvproxy', 'router'], not kvproxy alone" in found
    assert "the Deployment pins replicas that the HPA owns" in found


def test_checks_catch_a_drain_longer_than_kvproxys_own_stop() -> None:
    objs = copy.deepcopy(render(OVERLAY))
    set_config(objs, shutdown_grace_s=30)
    assert any("shutdown_grace_s 30 < drain_timeout_s 300" in p for p in problems_grace(objs))
    objs = copy.deepcopy(render(OVERLAY))
    set_config(objs, drain_timeout_s=600, shutdown_grace_s=600)
    assert any("terminationGracePeriodSeconds" in p for p in problems_grace(objs))
    objs = render(OVERLAY)
    del container(pod_spec(deployment(objs)), "kvproxy")["lifecycle"]
    assert any("no preStop sleep" in p for p in problems_grace(objs))


def test_checks_catch_a_shared_engine_and_an_unknown_router() -> None:
    objs = copy.deepcopy(render(OVERLAY))
    cfg = mounted_config(objs, pod_spec(deployment(objs)))
    clusters = cfg["upstreams"]
    clusters[1]["engines"] = clusters[0]["engines"]
    clusters[1]["url"] = "http://pd-router-b200:8000"
    set_config(objs, upstreams=clusters)
    found = problems_clusters(objs)
    assert "cluster h100's router pd-router-b200:8000 is not an example Service" in found
    assert "engine h200-prefill:30000 is in h200 and h100" in found
    set_config(objs, upstreams=clusters[:1])
    assert "the gateway lists 1 cluster(s), not several" in problems_clusters(objs)


def test_checks_catch_an_hpa_on_a_metric_nobody_serves() -> None:
    objs = render(OVERLAY)
    hpa = one(objs, "HorizontalPodAutoscaler")
    hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] = "kvproxy_requests_in_flight"
    found = problems_hpa(objs)
    assert "the HPA's metric kvproxy_requests_in_flight is not one kvproxy exports" in found
    assert any("serves kvproxy_requests_in_flight 0 times" in p for p in found)


def test_checks_catch_an_exposed_admin_port() -> None:
    objs = render(OVERLAY)
    one(objs, "Service", "kvproxy")["spec"]["ports"].append(
        {"name": "admin", "port": 9090, "targetPort": "admin"}
    )
    assert "Service kvproxy exposes port 9090" in problems_exposure(objs)


# --- the release gate checks what the Deployment will run ----------------------------------


def test_gateway_release_gate_checks_the_rolled_out_config_with_its_clusters(
    tmp_path: Path,
) -> None:
    app = render(OVERLAY)
    gate = render(f"{OVERLAY}/release-gate")
    job = one(gate, "Job", "kvproxy-check")

    def config_name(spec: Obj) -> str:
        names = [v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "kvproxy-config"]
        return str(names[0])

    app_spec = pod_spec(deployment(app))
    # Same content-hashed name: the gate checks exactly the config the rollout will mount.
    assert config_name(pod_spec(job)) == config_name(app_spec)
    check = container(pod_spec(job), "check")
    assert check["image"] == container(app_spec, "kvproxy")["image"]
    assert job["spec"]["backoffLimit"] == 0
    assert pod_spec(job)["restartPolicy"] == "Never"
    argv = container_argv(check)
    mount = next(m for m in check["volumeMounts"] if m["name"] == "kvproxy-config")
    assert argv[:4] == ["kvproxy", "check", "--config", f"{mount['mountPath']}/kvproxy.yaml"]
    assert argv[argv.index("--proxy") + 1] == "http://kvproxy:8080"
    assert gate_reach_problems(app, gate) == []
    # The gate's own command line, on the mounted file: it gates each configured cluster
    # on that cluster's engines (everything up to the probes, which need the clusters).
    config = tmp_path / "kvproxy.yaml"
    config.write_text(yaml.safe_dump(mounted_config(gate, pod_spec(job))), encoding="utf-8")
    plan = (
        "import sys, argparse; from kvproxy.tools import check_cli as c; "
        "from kvproxy.tools.check.cli import cluster_targets, gate_settings, check_sims; "
        "p = argparse.ArgumentParser(); c.add_arguments(p); a = p.parse_args(sys.argv[1:]); "
        "s = gate_settings(a); check_sims(a, s); [m] = s.model_table(); "
        "[print(t.name, t.url, *(e.url for e in t.gate.engines)) "
        "for t in cluster_targets(a, s, m)]"
    )
    args = [str(config) if a == argv[3] else a for a in argv[2:]]
    done = subprocess.run(
        [sys.executable, "-c", plan, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.upper().startswith("KVPROXY_")},
    )
    assert done.returncode == 0, done.stderr
    cfg = mounted_config(gate, pod_spec(job))
    assert done.stdout.splitlines() == [
        " ".join([c["name"], c["url"], *(e["url"] for e in c["engines"])]) for c in cfg["upstreams"]
    ]
