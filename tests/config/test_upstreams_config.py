"""Gateway mode's settings: a model's `upstreams` (clusters), the implicit `default` cluster of
the single-upstream forms, and the one-line errors (kvproxy.config.models.UpstreamCluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvproxy.budget.build import build_budget
from kvproxy.config import IMPLICIT_CLUSTER, ConfigError, load_settings
from kvproxy.observe.metrics import Metrics


def cluster(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "url": f"http://127.0.0.1:{port}",
        "engines": [
            {"url": f"http://127.0.0.1:{port + 1}", "role": "prefill"},
            {"url": f"http://127.0.0.1:{port + 2}", "role": "decode"},
        ],
        **extra,
    }


def test_the_single_upstream_form_is_one_default_cluster() -> None:
    s = load_settings(
        upstream="http://127.0.0.1:7000",
        engines=[{"url": "http://127.0.0.1:7001"}],
        router_kind="smg",
    )
    [spec] = s.model_table()
    [c] = s.clusters(spec)
    assert (c.name, c.url, c.weight, c.router_kind) == (
        IMPLICIT_CLUSTER,
        "http://127.0.0.1:7000",
        1.0,
        "smg",
    )
    assert c.engines == s.engines
    # The implicit cluster's settings are the model's own, unchanged (its budget pool too).
    assert s.for_cluster(spec, c) is s


def test_each_cluster_gets_its_engines_router_and_budget_pool() -> None:
    s = load_settings(
        upstreams=[cluster("h100", 7000, weight=3), cluster("a100", 7100, router_kind="smg")],
        router_kind="sglang-router",
        max_inflight_prompt_tokens=5000,
        budget_backend="redis",
        redis_url="redis://127.0.0.1:1/0",
    )
    [spec] = s.model_table()
    h100, a100 = s.clusters(spec)
    assert (h100.weight, h100.router_kind, a100.router_kind) == (3.0, "sglang-router", "smg")
    hs, as_ = s.for_cluster(spec, h100), s.for_cluster(spec, a100)
    assert [e.url for e in hs.engines] == ["http://127.0.0.1:7001", "http://127.0.0.1:7002"]
    assert (hs.upstream, as_.upstream) == ("http://127.0.0.1:7000", "http://127.0.0.1:7100")
    assert (hs.router_kind, as_.router_kind) == ("sglang-router", "smg")
    # A budget per cluster's pool, never one pool shared by different engines.
    pools = [build_budget(x, Metrics(), "default").options.pool for x in (hs, as_)]  # type: ignore[attr-defined]
    assert pools == ["default/h100", "default/a100"]
    assert hs.max_inflight_prompt_tokens == 5000


def test_upstreams_in_a_models_entry_with_affinity() -> None:
    s = load_settings(
        models=[
            {
                "name": "qwen",
                "upstreams": [cluster("big", 7000), cluster("small", 7100, budget_pool="p1")],
                "affinity_header": "X-Session-ID",
            },
            {"name": "glm", "engines": [{"url": "http://127.0.0.1:9001"}]},
        ],
        affinity_header="X-User",
    )
    qwen, glm = s.model_table()
    assert [c.name for c in s.clusters(qwen)] == ["big", "small"]
    assert s.for_cluster(qwen, s.clusters(qwen)[0]).budget_pool == "qwen/big"
    assert s.for_cluster(qwen, s.clusters(qwen)[1]).budget_pool == "p1"
    assert [c.name for c in s.clusters(glm)] == [IMPLICIT_CLUSTER]
    assert (s.affinity_for(qwen), s.affinity_for(glm)) == ("X-Session-ID", "X-User")


def test_upstreams_from_the_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "kvproxy.yaml"
    path.write_text(
        "upstreams:\n"
        "  - name: h100\n"
        "    url: http://pd-router-h100:8000\n"
        "    engines: [{url: 'http://h100-p:30000', role: prefill},"
        " {url: 'http://h100-d:30000', role: decode}]\n"
        "    weight: 2\n"
        "  - name: a100\n"
        "    url: http://pd-router-a100:8000\n"
        "    engines: [{url: 'http://a100-p:30000', role: prefill},"
        " {url: 'http://a100-d:30000', role: decode}]\n"
        "affinity_header: X-Session-ID\n"
        "upstream_eject_s: 5\n",
        encoding="utf-8",
    )
    s = load_settings(config_path=path)
    [spec] = s.model_table()
    assert [(c.name, c.weight) for c in s.clusters(spec)] == [("h100", 2.0), ("a100", 1.0)]
    assert (s.upstream_eject_s, s.upstream_eject_max_s) == (5.0, 120.0)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            {"upstreams": [cluster("a", 7000)], "engines": [{"url": "http://127.0.0.1:1"}]},
            "engines cannot be set next to upstreams",
        ),
        (
            {"upstreams": [cluster("a", 7000)], "upstream": "http://127.0.0.1:1"},
            "upstream cannot be set next to upstreams",
        ),
        (
            {"upstreams": [cluster("a", 7000), cluster("a", 7100)]},
            "cluster name 'a' is used twice",
        ),
        ({"upstreams": [cluster("has space", 7000)]}, "upstreams.0.name"),
        ({"upstreams": [cluster("x" * 65, 7000)]}, "upstreams.0.name"),
        ({"upstreams": [cluster("a", 7000, weight=0)]}, "upstreams.0.weight"),
        ({"upstreams": [cluster("a", 7000, weight=float("inf"))]}, "upstreams.0.weight"),
        ({"upstreams": [{**cluster("a", 7000), "engines": []}]}, "upstreams.0.engines"),
        ({"upstreams": [{**cluster("a", 7000), "url": "ftp://x"}]}, "upstreams.0.url"),
        ({"upstreams": [{**cluster("a", 7000), "extra": 1}]}, "upstreams.0.extra"),
        ({"affinity_header": "X Session"}, "affinity_header"),
        ({"upstream_eject_s": 30, "upstream_eject_max_s": 10}, "upstream_eject_max_s"),
        (
            {
                "models": [
                    {"name": "m", "upstreams": [cluster("a", 7000)], "upstream": "http://h:1"}
                ]
            },
            "upstream cannot be set next to upstreams",
        ),
        (
            {
                "models": [
                    {
                        "name": "m",
                        "upstreams": [cluster("a", 7000)],
                        "engines": [{"url": "http://h:1"}],
                    }
                ]
            },
            "engines cannot be set next to upstreams",
        ),
        ({"models": [{"name": "m"}]}, "at least one engine"),
        (
            {"models": [{"name": "m", "engines": [{"url": "http://h:1"}]}], "upstreams": []},
            "upstreams cannot be set next to models",
        ),
    ],
)
def test_bad_upstreams_fail_with_one_line(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    msg = str(info.value)
    assert "\n" not in msg
    assert needle in msg, msg
