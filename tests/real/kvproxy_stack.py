"""kvproxy as an operator runs it (`kvproxy serve --config FILE`, a child process in its own
process group) in front of the real engines of engines.py, and raw-socket clients that leave.

Settings the tests need beyond the defaults: a 1 s capacity refresh and a 30 s staleness bound
(half the default: on a busy 2-core CI machine an engine's API server answered /metrics more
than 4 s late while it prefilled, and the gate's canary got 503 capacity_unknown; the test of
staleness itself passes its own short bound), the canary tenants' tripwire (the harness's
default tenants), a drain timeout long enough for a queued prefill.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from engines import MODEL_NAME, Metrics, scrape, spawn_group, stop_group, wait_http
from ports import free_port

CANARY_TENANTS = ("canary-a", "canary-b")  # `kvproxy canary`'s default synthetic tenants


def engines_config(*engines: tuple[str, str]) -> list[dict[str, str]]:
    """[(url, role)] as kvproxy's `engines` entries (kind vllm: probed as vLLM)."""
    return [{"url": url, "role": role, "kind": "vllm"} for url, role in engines]


def proxy_config(upstream: str, engines: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "upstream": upstream,
        "engines": engines,
        "capacity_refresh_s": 1.0,
        "capacity_stale_s": 30.0,
        "drain_timeout_s": 120.0,
        "trust_tenant_header": True,
        "canaries": [
            {"tenant": t, "patterns": [f"KVCANARY-{t}-[0-9a-f]{{16}}"]} for t in CANARY_TENANTS
        ],
        **extra,
    }


@dataclass
class Kvproxy:
    url: str
    admin: str
    config: Path
    log: Path

    def metrics(self) -> Metrics:
        return scrape(self.admin)

    def capacity(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.admin + "/capacity", timeout=30) as resp:
            return dict(json.loads(resp.read()))


@contextlib.contextmanager
def kvproxy_serve(logs: Path, name: str, config: dict[str, Any]) -> Iterator[Kvproxy]:
    """`kvproxy serve --config` until the block ends; ready when /readyz is 200 (the engines
    measured)."""
    path = logs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = logs / f"{name}.log"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVPROXY_")}
    proc = spawn_group([sys.executable, "-m", "kvproxy", "serve", "--config", str(path)], log, env)
    proxy = Kvproxy(f"http://{config['listen']}", f"http://{config['admin_listen']}", path, log)
    try:
        wait_http(proxy.admin + "/readyz", proc, log, 120.0)
        yield proxy
    finally:
        stop_group(proc)


def post_chat(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def open_raw(url: str, body: dict[str, Any]) -> socket.socket:
    """A client that sends its request and reads nothing: closing the socket is leaving."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data) + data
    )
    return sock


def leave(sock: socket.socket) -> None:
    """Close at once (RST-free, FIN): the peer sees the client gone."""
    sock.close()


def body_of(content: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }
