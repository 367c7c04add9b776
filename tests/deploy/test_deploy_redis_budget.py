"""The redis-budget component composes with each overlay: every object stays valid, the
sidecar's settings load as a redis-backed budget that reads its password from the mounted
Secret, the router container is untouched, and only kvproxy pods may reach Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploytest import (
    container,
    find,
    mounted_config,
    one,
    overlays,
    pod_spec,
    render_with_components,
)
from test_deploy_render import validate

from kvproxy.config import load_settings


@pytest.mark.parametrize("overlay", overlays())
def test_redis_budget_composes_with_each_overlay(tmp_path: Path, overlay: str) -> None:
    objs = render_with_components(tmp_path, f"overlays/{overlay}", ["components/redis-budget"])
    for obj in objs:
        validate(obj)
    spec = pod_spec(one(objs, "Deployment", "kvproxy"))
    sidecar = container(spec, "kvproxy")
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    # What the process would load: the overlay's file plus the component's environment.
    cfg = mounted_config(objs, spec)
    settings = load_settings(
        **cfg,
        budget_backend=env["KVPROXY_BUDGET_BACKEND"],
        redis_url=env["KVPROXY_REDIS_URL"],
        redis_password_file=env["KVPROXY_REDIS_PASSWORD_FILE"],
        budget_expected_replicas=int(env["KVPROXY_BUDGET_EXPECTED_REPLICAS"]),
    )
    assert settings.budget_backend == "redis"
    assert settings.redis_url is not None
    assert "@" not in settings.redis_url.get_secret_value()  # no password in the URL
    # The password file is the mounted Secret.
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    secret = next(v for v in spec["volumes"] if v["name"] == "redis-password")
    assert secret["secret"]["secretName"] == "kvproxy-redis"
    assert env["KVPROXY_REDIS_PASSWORD_FILE"].startswith(mounts["redis-password"] + "/")
    # The expected replica count is the Deployment's (an outage's local shares add up).
    deployment = one(objs, "Deployment", "kvproxy")
    assert int(env["KVPROXY_BUDGET_EXPECTED_REPLICAS"]) == deployment["spec"]["replicas"]
    # Nothing of it reaches the router container.
    for c in spec["containers"]:
        assert not any(e["name"].startswith("KVPROXY_") for e in c.get("env", []))


def test_only_kvproxy_may_reach_redis(tmp_path: Path) -> None:
    objs = render_with_components(tmp_path, "overlays/sglang-pd", ["components/redis-budget"])
    policy = one(objs, "NetworkPolicy", "kvproxy-redis")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespace-wide or IP-block peer
    pods = find(objs, "Deployment", "kvproxy")[0]["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= pods.items()
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
