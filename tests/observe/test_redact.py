"""Credentials are never printed: passwords and tokens in URLs are redacted in config
errors, log lines and /capacity (kvproxy.observe.redact)."""

from __future__ import annotations

import io
import logging

import aiohttp
import pytest
from kvtest import running_proxy

from kvproxy.config import ConfigError, load_settings
from kvproxy.observe import JsonFormatter, redact

SECRET = "s3cretPW"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("http://user:s3cretPW@host:8000/x", "http://user:***@host:8000/x"),
        ("redis://:s3cretPW@redis:6379/0", "redis://:***@redis:6379/0"),
        ("https://s3cretPW@host", "https://***@host"),
        ("http://h/x?token=s3cretPW&a=1", "http://h/x?token=***&a=1"),
        ("http://h/x?api_key=s3cretPW", "http://h/x?api_key=***"),
        ("got 'ftp://u:s3cretPW@h:1' (and 1 more)", "got 'ftp://u:***@h:1' (and 1 more)"),
        ("http://host:8000/v1/models", "http://host:8000/v1/models"),
    ],
)
def test_redact(raw: str, shown: str) -> None:
    assert redact(raw) == shown


@pytest.mark.parametrize(
    "kw",
    [
        {"upstream": f"ftp://user:{SECRET}@host:1"},
        {"upstream": f"http://user:{SECRET}@host:notaport"},
        {"upstreams": [{"name": "a", "url": f"ftp://u:{SECRET}@h:1", "engines": []}]},
        {"engines": [{"url": f"ftp://u:{SECRET}@h:1", "role": "prefill"}]},
    ],
)
def test_config_errors_never_quote_a_password(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**kw)  # type: ignore[arg-type]
    assert SECRET not in str(caught.value)
    assert "***" in str(caught.value)


def test_log_lines_redact_urls() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("kvproxy.test.redact")
    log.addHandler(handler)
    try:
        log.warning("engine %s failed", f"http://u:{SECRET}@h:1/x?token={SECRET}")
        log.warning("probe", extra={"fields": {"url": f"http://u:{SECRET}@h:1"}})
    finally:
        log.removeHandler(handler)
    assert SECRET not in stream.getvalue()
    assert stream.getvalue().count("***") == 3


async def test_capacity_never_shows_a_password(http: aiohttp.ClientSession) -> None:
    engines = [
        {
            "url": f"http://u:{SECRET}@127.0.0.1:1",
            "role": "prefill",
            "kind": "static",
            "capacity_tokens": 1000,
        }
    ]
    async with running_proxy("http://127.0.0.1:1", engines=engines) as proxy:
        async with http.get(proxy.admin_url + "/capacity") as resp:
            text = await resp.text()
    assert "127.0.0.1:1" in text
    assert SECRET not in text
