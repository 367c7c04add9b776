"""`load_settings`: one loader, the config file as an argument, the environment read and
never written (serve, demo and check all load through it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvproxy.cli import _settings_from, build_parser
from kvproxy.config import ConfigError, load_settings
from kvproxy.tools.check.cli import options_from


def write_config(path: Path) -> Path:
    path.write_text(
        "max_context: 8192\n"
        "limit_margin_tokens: 15\n"
        "engines:\n"
        "  - {url: 'http://127.0.0.1:9', role: unified, kind: sglang}\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVPROXY_")]:
        monkeypatch.delenv(key)


@pytest.mark.usefixtures("clean_env")
def test_file_then_environment_then_overrides_and_the_environment_is_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path / "kvproxy.yaml")
    monkeypatch.setenv("KVPROXY_LIMIT_MARGIN_TOKENS", "20")  # the environment beats the file
    before = dict(os.environ)
    s = load_settings(config_path=config, overrides={"max_context": 4096, "tokenizer": None})
    assert dict(os.environ) == before
    assert s.max_context == 4096  # the override beats the file
    assert s.limit_margin_tokens == 20
    assert [e.url for e in s.engines] == ["http://127.0.0.1:9"]
    assert s.tokenizer == "auto"  # None means "not given": the default
    # The file was an argument of that call only: the next load does not see it.
    assert load_settings().engines == ()
    assert load_settings(max_context=100).max_context == 100  # keyword overrides still work


@pytest.mark.usefixtures("clean_env")
def test_an_unreadable_config_file_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml"):
        load_settings(config_path=tmp_path / "absent.yaml")


@pytest.mark.usefixtures("clean_env")
def test_serve_and_check_read_config_without_setting_the_environment(tmp_path: Path) -> None:
    """The old CLI and gate wrote KVPROXY_CONFIG into os.environ to reach the loader."""
    config = str(write_config(tmp_path / "kvproxy.yaml"))
    before = dict(os.environ)
    serve = build_parser(["serve"]).parse_args(["serve", "--config", config])
    settings = _settings_from(serve)
    assert settings.max_context == 8192
    check = build_parser(["check"]).parse_args(["check", "--config", config])
    opts = options_from(check)
    assert (opts.max_context, opts.limit_margin_tokens) == (8192, 15)
    assert dict(os.environ) == before
    assert "KVPROXY_CONFIG" not in os.environ


def test_router_kind_is_validated_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPROXY_ROUTER_KIND", "nginx")
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("invalid setting router_kind (KVPROXY_ROUTER_KIND):")
    assert "'smg'" in message
    assert "'auto'" in message
    monkeypatch.setenv("KVPROXY_ROUTER_KIND", "smg")
    assert load_settings().router_kind == "smg"
    monkeypatch.delenv("KVPROXY_ROUTER_KIND")
    assert load_settings().router_kind == "auto"


def test_router_kind_per_model_inherits_the_top_level_one() -> None:
    engines = [{"url": "http://127.0.0.1:1", "kind": "sglang"}]
    s = load_settings(
        router_kind="smg",
        models=[
            {"name": "a", "engines": engines},
            {"name": "b", "engines": engines, "router_kind": "none"},
        ],
    )
    assert [s.for_model(spec).router_kind for spec in s.model_table()] == ["smg", "none"]
    with pytest.raises(ConfigError, match=r"^invalid setting models\.0\.router_kind "):
        load_settings(models=[{"name": "a", "engines": engines, "router_kind": "haproxy"}])


def test_count_concurrency_defaults_to_the_cores_the_process_may_use() -> None:
    # One core (a pinned sidecar): one count at a time; a second count thread on the same
    # core doubled the CPU per long prompt (bench/PROFILE-LONG.md). An explicit value wins.
    import subprocess
    import sys

    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from kvproxy.config import Settings; "
        "print(Settings().count_concurrency, Settings(count_concurrency=3).count_concurrency)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "3"]
