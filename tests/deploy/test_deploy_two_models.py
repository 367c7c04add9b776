"""The two-models component composes with each overlay: the mounted kvproxy.yaml is the
component's, it loads as two models with distinct engines, and every object stays valid."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploytest import mounted_config, one, overlays, pod_spec, render_with_components
from test_deploy_render import validate

from kvproxy.config import load_settings


@pytest.mark.parametrize("overlay", overlays())
def test_two_models_compose_with_each_overlay(tmp_path: Path, overlay: str) -> None:
    objs = render_with_components(tmp_path, f"overlays/{overlay}", ["components/two-models"])
    for obj in objs:
        validate(obj)
    cfg = mounted_config(objs, pod_spec(one(objs, "Deployment", "kvproxy")))
    settings = load_settings(**cfg)
    specs = settings.model_table()
    assert [spec.name for spec in specs] == ["Qwen/Qwen3-8B", "zai-org/GLM-4.7"]
    urls = [{e.url for e in settings.for_model(spec).engines} for spec in specs]
    assert not urls[0] & urls[1]  # each model measured on its own engines
    assert settings.default_model == "Qwen/Qwen3-8B"
    assert settings.readiness == "any"
