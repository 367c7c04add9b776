"""The safety properties of the rendered manifests, read from the rendered YAML itself.

Each property is a `problems_*` function returning what is wrong; the shipped overlays must
have none, and a deliberately broken copy must be caught, so the checks cannot pass
vacuously. Numbers come from the same ConfigMap the Pod mounts, and kvproxy's own defaults
come from kvproxy.config.settings.Settings.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploytest import (
    Obj,
    all_containers,
    container,
    container_argv,
    exposure_problems,
    find,
    gate_reach_problems,
    mounted_config,
    one,
    overlays,
    pod_spec,
    render,
    resolve_port,
)

from kvproxy.config import Settings, load_settings, split_host_port

OVERLAYS = overlays()


def setting(cfg: Obj, name: str) -> Any:
    """A value from kvproxy.yaml, or kvproxy's own default when the file leaves it out."""
    return cfg.get(name, Settings.model_fields[name].default)


def flag(args: list[str], name: str) -> str | None:
    """Value of --name=V or --name V in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def deployment(objs: list[Obj]) -> Obj:
    return one(objs, "Deployment", "kvproxy")


def set_config(objs: list[Obj], **changes: Any) -> None:
    """Edit the mounted kvproxy.yaml in place (for the negative tests)."""
    cfg = mounted_config(objs, pod_spec(deployment(objs)))
    cfg.update(changes)
    name = next(
        v["configMap"]["name"]
        for v in pod_spec(deployment(objs))["volumes"]
        if v["name"] == "kvproxy-config"
    )
    one(objs, "ConfigMap", name)["data"]["kvproxy.yaml"] = yaml.safe_dump(cfg)


# --- the properties ------------------------------------------------------------------------


def problems_sidecar(objs: list[Obj]) -> list[str]:
    spec = pod_spec(deployment(objs))
    inits = {c["name"]: c for c in spec.get("initContainers", [])}
    mains = {c["name"] for c in spec.get("containers", [])}
    out = []
    if "kvproxy" not in inits:
        out.append("kvproxy is not an init container")
    elif inits["kvproxy"].get("restartPolicy") != "Always":
        out.append("kvproxy is an init container without restartPolicy: Always (not a sidecar)")
    if "kvproxy" in mains:
        out.append("kvproxy is a regular container")
    if "router" not in mains:
        out.append("the router is not a regular container")
    if any(c.get("restartPolicy") != "Always" for c in spec.get("initContainers", [])):
        out.append("a run-to-completion init container would delay or block the sidecar")
    return out


def problems_grace(objs: list[Obj]) -> list[str]:
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    drain_s = float(setting(cfg, "drain_timeout_s"))
    shutdown_s = float(setting(cfg, "shutdown_grace_s"))
    grace_s = float(spec.get("terminationGracePeriodSeconds", 30))
    router = container(spec, "router")
    hook = router.get("lifecycle", {}).get("preStop", {})
    command = hook.get("exec", {}).get("command", [])
    if not any(part.endswith("wait_for_kvproxy_drain.py") for part in command):
        return ["the router has no preStop hook waiting for kvproxy to drain"]
    delay_s = float(flag(command, "--endpoint-delay-s") or 10)
    wait_s = float(flag(command, "--max-wait-s") or 0)
    router_exit_s = float(flag(router.get("args", []), "--shutdown-grace-period-secs") or 0)
    out = []
    if delay_s < 5:
        out.append(f"preStop endpoint delay {delay_s:g} s is too short for endpoints to update")
    if grace_s < delay_s + drain_s + shutdown_s:
        out.append(
            f"terminationGracePeriodSeconds {grace_s:g} < preStop {delay_s:g} + "
            f"drain_timeout_s {drain_s:g} + shutdown_grace_s {shutdown_s:g}"
        )
    if wait_s != drain_s + shutdown_s:
        out.append(f"preStop --max-wait-s {wait_s:g} != drain_timeout_s + shutdown_grace_s")
    # After the wait the router must exit and kvproxy still shut down inside the grace period.
    if grace_s - delay_s - wait_s < router_exit_s + 5:
        out.append("no time left in the grace period for the router and kvproxy to exit")
    return out


def problems_probes(objs: list[Obj]) -> list[str]:
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    admin_port = split_host_port(setting(cfg, "admin_listen"))[1]
    public_port = split_host_port(setting(cfg, "listen"))[1]
    kv = container(spec, "kvproxy")
    expected = {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    out = []
    if admin_port == public_port:
        out.append("the admin port is the public port")
    for probe, path in expected.items():
        get = kv.get(probe, {}).get("httpGet")
        if get is None:
            out.append(f"kvproxy has no {probe} httpGet")
            continue
        if resolve_port(kv, get["port"]) != admin_port:
            out.append(f"kvproxy {probe} does not probe the admin port {admin_port}")
        if get["path"] != path:
            out.append(f"kvproxy {probe} probes {get['path']}, not {path}")
    return out


def problems_exposure(objs: list[Obj]) -> list[str]:
    dep = deployment(objs)
    spec = pod_spec(dep)
    cfg = mounted_config(objs, spec)
    public_port = split_host_port(setting(cfg, "listen"))[1]
    upstream = urlsplit(setting(cfg, "upstream"))
    router = container(spec, "router")
    out = []
    if upstream.hostname not in ("127.0.0.1", "localhost", "::1"):
        out.append(f"kvproxy's upstream {upstream.hostname} is not the router on loopback")
    if flag(router.get("args", []), "--host") != "127.0.0.1":
        out.append("the router does not bind to 127.0.0.1")
    if flag(router.get("args", []), "--port") != str(upstream.port):
        out.append("the router's --port is not kvproxy's upstream port")
    if router.get("ports"):
        out.append("the router declares container ports")
    if spec.get("hostNetwork") or any(
        p.get("hostPort") for c in all_containers(spec) for p in c.get("ports", [])
    ):
        out.append("the Pod uses the host network or host ports")
    admin_port = split_host_port(setting(cfg, "admin_listen"))[1]
    return out + exposure_problems(objs, dep, public_port, admin_port)


def problems_security(spec: Obj) -> list[str]:
    out = []
    pod_sc = spec.get("securityContext", {})
    if pod_sc.get("runAsNonRoot") is not True:
        out.append("Pod runAsNonRoot is not true")
    if pod_sc.get("runAsUser", 1) == 0:
        out.append("Pod runs as UID 0")
    if pod_sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        out.append("Pod has no RuntimeDefault seccomp profile")
    if spec.get("automountServiceAccountToken") is not False:
        out.append("the service account token is mounted")
    if spec.get("enableServiceLinks") is not False:
        out.append("service links inject KVPROXY_* variables into kvproxy's settings namespace")
    for c in all_containers(spec):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: root filesystem is writable")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc["capabilities"].get("add"):
            out.append(f"{name}: capabilities are not all dropped")
        if sc.get("privileged") or sc.get("runAsUser") == 0:
            out.append(f"{name}: runs privileged or as root")
        res = c.get("resources", {})
        if not {"cpu", "memory"} <= res.get("requests", {}).keys():
            out.append(f"{name}: no cpu/memory requests")
        if "memory" not in res.get("limits", {}):
            out.append(f"{name}: no memory limit")
    return out


def problems_engines(objs: list[Obj]) -> list[str]:
    """The router's engine Pods are the Pods behind kvproxy's engine Services, same port."""
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    args = container(spec, "router").get("args", [])
    polled = {
        (e["role"], urlsplit(e["url"]).hostname, urlsplit(e["url"]).port) for e in cfg["engines"]
    }
    routed = []
    for i, arg in enumerate(args[:-1]):
        if arg in ("--prefill", "--decode"):
            url = urlsplit(args[i + 1])
            # <pod>.<service>[.<namespace>.svc...]: the Service is the second label.
            labels = (url.hostname or "").split(".")
            service = labels[1] if len(labels) > 1 else labels[0]
            routed.append((arg.lstrip("-"), service, url.port))
    out = [
        f"router sends {role} to {service}:{port}, which kvproxy does not poll"
        for role, service, port in routed
        if (role, service, port) not in polled
    ]
    for role in ("prefill", "decode"):
        if not any(r[0] == role for r in routed):
            out.append(f"the router has no {role} engine")
        if not any(p[0] == role for p in polled):
            out.append(f"kvproxy polls no {role} engine")
    return out


def problems_rollout(objs: list[Obj]) -> list[str]:
    dep = deployment(objs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    out = []
    if dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] != 0:
        out.append("a rollout may take replicas away before new ones are ready")
    pdbs = [
        p
        for p in find(objs, "PodDisruptionBudget")
        if p["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ]
    if len(pdbs) != 1:
        out.append("no PodDisruptionBudget covers the Pods")
    elif "maxUnavailable" not in pdbs[0]["spec"]:
        out.append("the PodDisruptionBudget should bound unavailability, not pin a count")
    return out


def problems_network_policy(objs: list[Obj]) -> list[str]:
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    public_port = split_host_port(setting(cfg, "listen"))[1]
    admin_port = split_host_port(setting(cfg, "admin_listen"))[1]
    kv = container(spec, "kvproxy")
    pod_labels = deployment(objs)["spec"]["template"]["metadata"]["labels"]
    policies = [
        p
        for p in find(objs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ]
    if not policies or not all("Ingress" in p["spec"]["policyTypes"] for p in policies):
        return ["no ingress NetworkPolicy selects the Pods"]
    out = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = {resolve_port(kv, p["port"]) for p in rule.get("ports", [])}
            if not ports:
                out.append("an ingress rule allows every port")
            if ports - {public_port, admin_port}:
                out.append(f"ingress allowed to ports {sorted(ports - {public_port, admin_port})}")
            if admin_port in ports and not rule.get("from"):
                out.append("the admin port is open to everyone")
    return out


ALL_CHECKS = (
    problems_sidecar,
    problems_grace,
    problems_probes,
    problems_exposure,
    problems_engines,
    problems_rollout,
    problems_network_policy,
)


# --- the shipped overlays have none of these problems --------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda f: f.__name__)
def test_overlay_is_safe(overlay: str, check: Any) -> None:
    assert check(render(f"overlays/{overlay}")) == []


@pytest.mark.parametrize("rel", [*(f"overlays/{o}" for o in OVERLAYS), "release-gate"])
def test_security_context(rel: str) -> None:
    for workload in [*find(render(rel), "Deployment"), *find(render(rel), "Job")]:
        assert problems_security(pod_spec(workload)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_loads_with_kvproxys_own_settings(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(f"overlays/{overlay}")
    spec = pod_spec(deployment(objs))
    cfg = mounted_config(objs, spec)
    path = tmp_path / "kvproxy.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    for key in list(os.environ):
        if key.upper().startswith("KVPROXY_"):
            monkeypatch.delenv(key)
    env = {e["name"]: e.get("value") for e in container(spec, "kvproxy").get("env", [])}
    assert env["KVPROXY_CONFIG"] == "/etc/kvproxy/kvproxy.yaml"
    mount = next(
        m for m in container(spec, "kvproxy")["volumeMounts"] if m["name"] == "kvproxy-config"
    )
    assert mount["mountPath"] == "/etc/kvproxy"
    assert mount["readOnly"] is True
    monkeypatch.setenv("KVPROXY_CONFIG", str(path))
    settings = load_settings()
    assert settings.engines, "an overlay must name its engines"
    assert settings.max_context is not None
    kv = container(spec, "kvproxy")
    assert resolve_port(kv, "http") == settings.listen_host_port[1]
    assert resolve_port(kv, "admin") == settings.admin_host_port[1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_engines_have_example_services(overlay: str) -> None:
    # The example headless Services carry the ports the router and kvproxy both dial.
    path = Path(__file__).resolve().parents[2] / "deploy" / "overlays" / overlay
    services = {
        d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]}
        for d in yaml.safe_load_all((path / "engine-services.example.yaml").read_text())
        if d
    }
    cfg = mounted_config(
        render(f"overlays/{overlay}"), pod_spec(deployment(render(f"overlays/{overlay}")))
    )
    for engine in cfg["engines"]:
        url = urlsplit(engine["url"])
        assert url.port in services[url.hostname or ""]


def test_the_hook_mounted_is_the_hook_tested() -> None:
    objs = render("base")
    spec = pod_spec(deployment(objs))
    vol = next(v for v in spec["volumes"] if v["name"] == "kvproxy-hooks")
    hooks = one(objs, "ConfigMap", vol["configMap"]["name"])
    on_disk = Path(__file__).resolve().parents[2] / "deploy/base/hooks/wait_for_kvproxy_drain.py"
    assert hooks["data"]["wait_for_kvproxy_drain.py"] == on_disk.read_text(encoding="utf-8")
    router = container(spec, "router")
    mount = next(m for m in router["volumeMounts"] if m["name"] == "kvproxy-hooks")
    assert router["lifecycle"]["preStop"]["exec"]["command"][1].startswith(mount["mountPath"])


# --- the checks catch what they claim to catch ---------------------------------------------


def test_checks_catch_a_drain_timeout_raised_without_the_grace_period() -> None:
    objs = copy.deepcopy(render("overlays/sglang-pd"))
    set_config(objs, drain_timeout_s=600)
    found = problems_grace(objs)
    assert any("terminationGracePeriodSeconds" in p for p in found)
    assert any("--max-wait-s" in p for p in found)


def test_checks_catch_a_plain_container_and_an_exposed_router() -> None:
    objs = render("overlays/vllm")
    spec = pod_spec(deployment(objs))
    spec["containers"].append(spec.pop("initContainers")[0])
    del spec["containers"][-1]["restartPolicy"]
    assert "kvproxy is not an init container" in problems_sidecar(objs)

    objs = render("overlays/vllm")
    router = container(pod_spec(deployment(objs)), "router")
    router["args"][router["args"].index("127.0.0.1")] = "0.0.0.0"
    router["ports"] = [{"name": "router", "containerPort": 8000}]
    one(objs, "Service", "kvproxy")["spec"]["ports"].append(
        {"name": "router", "port": 8000, "targetPort": 9090}
    )
    found = problems_exposure(objs)
    assert "the router does not bind to 127.0.0.1" in found
    assert "Service kvproxy exposes port 9090" in found


def test_checks_catch_probes_on_the_public_port_and_a_writable_root() -> None:
    objs = render("overlays/sglang-pd")
    spec = pod_spec(deployment(objs))
    container(spec, "kvproxy")["readinessProbe"]["httpGet"]["port"] = "http"
    assert "kvproxy readinessProbe does not probe the admin port 9090" in problems_probes(objs)
    container(spec, "router")["securityContext"]["readOnlyRootFilesystem"] = False
    spec["enableServiceLinks"] = True
    found = problems_security(spec)
    assert "router: root filesystem is writable" in found
    assert any("service links" in p for p in found)


def test_checks_catch_an_engine_kvproxy_does_not_poll() -> None:
    objs = render("overlays/sglang-pd")
    router = container(pod_spec(deployment(objs)), "router")
    router["args"] += ["--decode", "http://other-decode-0.other-decode:30000"]
    assert problems_engines(objs) == [
        "router sends decode to other-decode:30000, which kvproxy does not poll"
    ]


def test_checks_catch_an_open_admin_port() -> None:
    objs = render("overlays/sglang-pd")
    policy = one(objs, "NetworkPolicy", "kvproxy")
    policy["spec"]["ingress"][0]["ports"].append({"port": "admin", "protocol": "TCP"})
    assert "the admin port is open to everyone" in problems_network_policy(objs)


# --- the release gate checks what the Deployment will run ----------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_release_gate_uses_the_overlays_config_and_image(overlay: str) -> None:
    app = render(f"overlays/{overlay}")
    gate = render(f"overlays/{overlay}/release-gate")
    job = one(gate, "Job", "kvproxy-check")
    app_spec = pod_spec(deployment(app))

    def config_name(spec: Obj) -> str:
        names = [v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "kvproxy-config"]
        return str(names[0])

    # Same content-hashed name: the gate checks exactly the config the rollout will mount.
    assert config_name(pod_spec(job)) == config_name(app_spec)
    assert container(pod_spec(job), "check")["image"] == container(app_spec, "kvproxy")["image"]
    # A failed gate must stay failed, not be retried into a pass.
    assert job["spec"]["backoffLimit"] == 0
    assert pod_spec(job)["restartPolicy"] == "Never"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_release_gate_runs_kvproxy_check_with_the_configured_engines(
    overlay: str, tmp_path: Path
) -> None:
    gate = render(f"overlays/{overlay}/release-gate")
    job = one(gate, "Job", "kvproxy-check")
    check = container(pod_spec(job), "check")
    argv = container_argv(check)
    mount = next(m for m in check["volumeMounts"] if m["name"] == "kvproxy-config")
    # The gate reads the mounted kvproxy.yaml through kvproxy's own loader (--config) ...
    assert argv[:4] == ["kvproxy", "check", "--config", f"{mount['mountPath']}/kvproxy.yaml"]
    assert flag(argv, "--proxy") == "http://kvproxy:8080"
    # ... reads the proxy's limit and deferral counts on its admin port ...
    assert flag(argv, "--proxy-admin") == "http://kvproxy-admin:9090"
    # ... and runs the isolation scenarios, keeping the record.
    assert "--canary" in argv
    assert flag(argv, "--out") == "/records"
    # The gate's own options from the mounted file: every engine, and a declared context to
    # compare the measured pools with (without one that check would not run).
    cfg = mounted_config(gate, pod_spec(job))
    config = tmp_path / "kvproxy.yaml"
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    plan = (
        "import sys, argparse, json; from kvproxy.tools import check_cli as c; "
        "from kvproxy.tools.check.cli import options_from; "
        "p = argparse.ArgumentParser(); c.add_arguments(p); "
        "o = options_from(p.parse_args(sys.argv[1:])); "
        "print(json.dumps([[e.url for e in o.engines], o.max_context, o.proxy, o.proxy_admin]))"
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
    assert json.loads(done.stdout) == [
        [e["url"] for e in cfg["engines"]],
        cfg["max_context"],
        "http://kvproxy:8080",
        "http://kvproxy-admin:9090",
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_release_gate_reaches_the_proxy_and_its_admin_port(overlay: str) -> None:
    assert (
        gate_reach_problems(
            render(f"overlays/{overlay}"), render(f"overlays/{overlay}/release-gate")
        )
        == []
    )


def test_checks_catch_a_gate_without_admin_access() -> None:
    app = render("overlays/sglang-pd")
    gate = render("overlays/sglang-pd/release-gate")
    # The NetworkPolicy of before: only Prometheus reaches the admin port.
    policy = one(app, "NetworkPolicy", "kvproxy")
    policy["spec"]["ingress"] = [
        r
        for r in policy["spec"]["ingress"]
        if "namespaceSelector" in str(r.get("from", "")) or not r.get("from")
    ]
    assert gate_reach_problems(app, gate) == [
        "no NetworkPolicy admits the gate Job to the admin port"
    ]
    # The Job of before: no --proxy-admin; and an admin URL naming no Service.
    gate = render("overlays/sglang-pd/release-gate")
    check = container(pod_spec(one(gate, "Job", "kvproxy-check")), "check")
    i = check["args"].index("--proxy-admin")
    del check["args"][i : i + 2]
    assert gate_reach_problems(render("overlays/sglang-pd"), gate) == [
        "the gate has no --proxy-admin"
    ]
    app = render("overlays/sglang-pd")
    app.remove(one(app, "Service", "kvproxy-admin"))
    assert gate_reach_problems(app, render("overlays/sglang-pd/release-gate")) == [
        "the gate's --proxy-admin http://kvproxy-admin:9090 is no Service on port 9090"
    ]


def test_checks_catch_the_admin_port_beside_the_public_one() -> None:
    objs = render("overlays/sglang-pd")
    one(objs, "Service", "kvproxy")["spec"]["ports"].append(
        {"name": "admin", "port": 9090, "targetPort": "admin"}
    )
    assert "Service kvproxy exposes port 9090" in problems_exposure(objs)
