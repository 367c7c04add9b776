"""The `models` setting: entries, the single-model form, and the config errors that keep two
entries from answering to one name (kvproxy.config.models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvproxy.budget.build import build_budget
from kvproxy.config import IMPLICIT_MODEL, ConfigError, load_settings
from kvproxy.observe.metrics import Metrics


def engines(port: int) -> list[dict[str, Any]]:
    return [
        {"url": f"http://127.0.0.1:{port}", "role": "prefill"},
        {"url": f"http://127.0.0.1:{port + 1}", "role": "decode"},
    ]


def two_models(**extra: Any) -> list[dict[str, Any]]:
    return [
        {"name": "qwen", "aliases": ["Qwen/Qwen3-8B"], "engines": engines(31000), **extra},
        {"name": "glm", "engines": engines(32000), "tokenizer": "bytes", "max_context": 4096},
    ]


def test_single_model_form_is_one_entry_with_the_top_level_settings() -> None:
    s = load_settings(engines=engines(30000), max_context=8192, tokenizer="bytes")
    [spec] = s.model_table()
    assert spec.name == IMPLICIT_MODEL
    assert spec.engines == s.engines
    assert (spec.max_context, spec.tokenizer) == (8192, "bytes")
    assert s.for_model(spec) is s


def test_each_entry_gets_its_own_engines_tokenizer_budget_and_upstream() -> None:
    s = load_settings(
        models=two_models(max_inflight_prompt_tokens=1000, upstream="http://127.0.0.1:7000/"),
        upstream="http://127.0.0.1:8000",
    )
    qspec, gspec = s.model_table()
    q, g = s.for_model(qspec), s.for_model(gspec)
    assert qspec.names == ("qwen", "Qwen/Qwen3-8B")
    assert [e.url for e in q.engines] == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert q.max_inflight_prompt_tokens == 1000
    assert g.max_inflight_prompt_tokens is None
    assert q.upstream == "http://127.0.0.1:7000"
    assert g.upstream == "http://127.0.0.1:8000"
    assert g.max_context == 4096
    assert q.max_context is None
    assert gspec.tokenizer == "bytes"


def test_one_redis_budget_pool_per_model_by_default() -> None:
    s = load_settings(
        models=[*two_models()[:1], {**two_models()[1], "budget_pool": "shared-glm"}],
        budget_backend="redis",
        redis_url="redis://127.0.0.1:1/0",
    )
    pools = []
    for spec in s.model_table():
        budget = build_budget(s.for_model(spec), Metrics(), spec.name)
        pools.append(budget.options.pool)  # type: ignore[attr-defined]
    # By default the model's name: replicas in front of the same engines share it.
    assert pools == ["qwen", "shared-glm"]


def test_models_from_the_yaml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvproxy.yaml"
    path.write_text(
        "models:\n"
        "  - name: a\n"
        "    engines: [{url: 'http://127.0.0.1:1', role: unified}]\n"
        "  - name: b\n"
        "    aliases: [bee]\n"
        "    engines: [{url: 'http://127.0.0.1:2', role: unified}]\n"
        "default_model: b\n"
        "readiness: all\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("KVPROXY_CONFIG", str(path))
    s = load_settings()
    assert [m.name for m in s.models] == ["a", "b"]
    assert s.default_model == "b"
    assert s.readiness == "all"


@pytest.mark.parametrize(
    ("models", "needle"),
    [
        (
            [{"name": "a", "engines": engines(1)}, {"name": "a", "engines": engines(3)}],
            "'a' is used twice in models",
        ),
        (
            [
                {"name": "a", "aliases": ["x"], "engines": engines(1)},
                {"name": "b", "aliases": ["x"], "engines": engines(3)},
            ],
            "'x' is used by a and b",
        ),
        (
            [
                {"name": "a", "engines": engines(1)},
                {"name": "b", "aliases": ["a"], "engines": engines(3)},
            ],
            "'a' is used by a and b",
        ),
        (
            [{"name": "a", "aliases": ["a"], "engines": engines(1)}],
            "'a' is used twice in models",
        ),
    ],
)
def test_duplicate_names_or_aliases_are_one_clear_config_error(
    models: list[dict[str, Any]], needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(models=models)
    msg = str(info.value)
    assert needle in msg
    assert "\n" not in msg
    assert msg.startswith("invalid setting")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"models": [{"name": "a", "engines": []}]}, "a models entry needs at least one engine"),
        ({"models": [{"name": "a b", "engines": engines(1)}]}, "models.0.name"),
        ({"models": [{"name": "a", "engines": engines(1), "tokenizer": "qwen"}]}, "tokenizer"),
        ({"models": [{"name": "a", "engines": engines(1), "upstream": "x"}]}, "upstream"),
        ({"models": [{"name": "a", "engines": engines(1), "typo": 1}]}, "models.0.typo"),
        ({"models": two_models(), "default_model": "nope"}, "default_model 'nope'"),
        ({"default_model": "a"}, "default_model needs a models list"),
        ({"models": two_models(), "readiness": "some"}, "readiness"),
        # The single-model fields belong to one model's engines: never inherited silently.
        ({"models": two_models(), "tokenizer": "bytes"}, "tokenizer cannot be set next to"),
        ({"models": two_models(), "engines": engines(1)}, "engines cannot be set next to"),
        ({"models": two_models(), "max_inflight_requests": 4}, "max_inflight_requests"),
    ],
)
def test_bad_models_settings_fail_with_one_line(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_models_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import orjson

    monkeypatch.setenv("KVPROXY_MODELS", orjson.dumps(two_models()).decode())
    monkeypatch.setenv("KVPROXY_DEFAULT_MODEL", "glm")
    s = load_settings()
    assert [m.name for m in s.models] == ["qwen", "glm"]
    assert s.default_model == "glm"
