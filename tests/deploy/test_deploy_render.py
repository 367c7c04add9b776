"""Every kustomization under deploy/ renders, and every rendered object is valid.

Built-in kinds are validated offline against the Kubernetes 1.33 schemas in strict mode
(unknown fields fail) by kubernetes-validate; the Prometheus Operator kinds, whose CRD
schemas are not bundled, against the structural schemas in deploytest.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploytest import (
    CRD_SCHEMAS,
    DEPLOY,
    GATEWAY_OVERLAYS,
    KUBERNETES_VERSION,
    Obj,
    all_containers,
    find,
    kustomizations,
    overlays,
    pod_spec,
    render,
    render_with_components,
)

# The base leaves the router image to the overlays; everything else is meant to be applied.
DEPLOYABLE = [k for k in kustomizations() if k != "base"]
EXAMPLE_MANIFESTS = sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.example.yaml"))


def validate(obj: Obj) -> None:
    schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_there_is_something_to_render() -> None:
    assert {"sglang-pd", "vllm"} <= set(overlays())
    assert {f"overlays/{o}" for o in GATEWAY_OVERLAYS} <= set(kustomizations())
    assert {"base", "monitoring", "release-gate"} <= set(kustomizations())
    assert {f"overlays/{o}/release-gate" for o in overlays()} <= set(kustomizations())


@pytest.mark.parametrize("rel", kustomizations())
def test_renders_and_validates(rel: str) -> None:
    objs = render(rel)
    assert objs, f"{rel} rendered nothing"
    for obj in objs:
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{rel}: {name} invalid at {list(exc.absolute_path)}: {exc.message}")


@pytest.mark.parametrize("rel", kustomizations())
def test_no_duplicate_objects(rel: str) -> None:
    keys = [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in render(rel)]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("rel", kustomizations())
def test_every_mounted_configmap_is_rendered(rel: str) -> None:
    # A hash-suffixed name that kustomize failed to rewrite would leave the Pod pending.
    objs = render(rel)
    configmaps = {o["metadata"]["name"] for o in find(objs, "ConfigMap")}
    for workload in [*find(objs, "Deployment"), *find(objs, "Job")]:
        for vol in pod_spec(workload).get("volumes", []):
            if "configMap" in vol:
                assert vol["configMap"]["name"] in configmaps


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_images_are_pinned(rel: str) -> None:
    for workload in [*find(render(rel), "Deployment"), *find(render(rel), "Job")]:
        for c in all_containers(pod_spec(workload)):
            image: str = c["image"]
            # The tag is after the last ":" of the last path segment (a registry may have a
            # port); a digest pins whatever the tag says.
            tag = image.split("@", 1)[0].rsplit("/", 1)[-1].partition(":")[2]
            assert "/" in image, f"{image}: name the registry and repository"
            assert "@sha256:" in image or tag not in ("", "latest"), f"{image} is not pinned"


@pytest.mark.parametrize("rel", EXAMPLE_MANIFESTS)
def test_example_manifests_validate(rel: str) -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / rel).read_text(encoding="utf-8")) if d]
    assert docs
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("overlay", overlays())
def test_hpa_example_composes_with_each_overlay(tmp_path: Path, overlay: str) -> None:
    objs = render_with_components(tmp_path, f"overlays/{overlay}", ["examples/hpa"])
    for obj in objs:
        validate(obj)
    hpa = find(objs, "HorizontalPodAutoscaler")[0]
    target = hpa["spec"]["scaleTargetRef"]
    deployment = find(objs, target["kind"], target["name"])
    assert deployment, "the HPA scales a Deployment that is not rendered"
    # The HPA owns the replica count; a rendered one would be reset on every apply.
    assert "replicas" not in deployment[0]["spec"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == "kvproxy_inflight_requests"


def test_strict_validation_is_not_vacuous() -> None:
    # The same validator must reject a misspelt field and a wrong type, or the tests above
    # prove nothing.
    deployment = find(render("overlays/sglang-pd"), "Deployment")[0]
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 360
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    monitor = find(render("monitoring"), "PodMonitor")[0]
    monitor["spec"]["podMetricsEndpoint"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector's verdict on a Pod's labels (matchLabels and In/NotIn/Exists)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        held = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not held:
            return False
    return True


@pytest.mark.parametrize("rel", ["base", *(f"overlays/{o}" for o in GATEWAY_OVERLAYS)])
def test_monitoring_targets_the_admin_port_of_every_kvproxy_pod(rel: str) -> None:
    objs = render("monitoring")
    monitor = find(objs, "PodMonitor")[0]
    deployment = find(render(rel), "Deployment")[0]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(monitor["spec"]["selector"], pod_labels)
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["admin"]
    assert find(objs, "PrometheusRule"), "deploy/monitoring must ship the alert rules"
