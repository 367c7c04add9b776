"""`kvproxy check`'s command line (kvproxy.tools.check.cli): flags over the config file, through
the proxy's own loader."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kvproxy.tools.check.cli import options_from


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVPROXY_")]:
        monkeypatch.delenv(key)


@pytest.mark.usefixtures("clean_env")
def test_check_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "kvproxy.yaml"
    config.write_text(
        "max_context: 8192\nlimit_margin_tokens: 15\n"
        "engines: [{url: 'http://127.0.0.1:9', role: unified}]\n",
        encoding="utf-8",
    )
    args = argparse.Namespace(
        config=str(config),
        engines='[{"url": "http://127.0.0.1:8", "role": "prefill"}]',
        max_context=5315,
        proxy=None,
        proxy_admin=None,
        sim=None,
        canary=False,
        unknown_probe=None,
        out=None,
        model=None,
        accept_drain_timeouts=False,
        canary_allow_partial=False,
        canary_rounds=4,
        canary_prompt_chars=None,
        probe_kind="auto",
    )
    opts = options_from(args)
    assert opts.max_context == 5315
    assert [e.url for e in opts.engines] == ["http://127.0.0.1:8"]
    assert opts.limit_margin_tokens == 15  # the rest still comes from the file
