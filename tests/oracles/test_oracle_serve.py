"""Through a real `kvproxy serve` (a subprocess, static pool, the model's `hf:` tokenizer)
with a capture worker as its upstream: the in-process adapter (`kvproxy_side`) decides as
the server does, and the issue's own body is refused and never forwarded.

The issue's body: one "System" message of ~200 tokens, Qwen-3's tokenizer and template, a
static pool of 50 tokens. SGLang lower-cases the role and renders ~215 tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from kvtest import serve_ready
from ports import free_port

from oracles import sglang
from oracles.capture import Capture, capture_worker
from oracles.corpus import BY_NAME, W, chat, user
from oracles.kvproxy_side import ROUTES, KvproxySide, settings_for
from oracles.models import load_model

READY_TIMEOUT_S = 30.0  # a loaded machine takes a while to load the tokenizer


@dataclass
class Served:
    public: str
    limit_tokens: int
    upstream: Capture


def _env(settings: dict[str, Any]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    for key, value in settings.items():
        env[f"KVPROXY_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def _static(capacity: int) -> list[dict[str, Any]]:
    return [
        {"url": "static://pool", "role": "unified", "kind": "static", "capacity_tokens": capacity}
    ]


@contextlib.asynccontextmanager
async def served(model: str, capacity: int) -> AsyncIterator[Served]:
    async with capture_worker() as upstream:
        port, admin = free_port(), free_port()
        settings = settings_for(load_model(model).directory, "sglang", engines=_static(capacity))
        settings.update(
            listen=f"127.0.0.1:{port}", admin_listen=f"127.0.0.1:{admin}", upstream=upstream.url
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvproxy",
            "serve",
            env=_env(settings),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            limit = await serve_ready(proc, admin, lambda: _stderr(proc), READY_TIMEOUT_S)
            yield Served(f"http://127.0.0.1:{port}", limit, upstream)
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    err = await proc.stderr.read() if proc.stderr else b""
    return repr(err[-2000:])


async def _post(srv: Served, route: str, body: bytes) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            srv.public + ROUTES[route], data=body, headers={"content-type": "application/json"}
        ) as r:
            await r.read()
            return r.status, dict(r.headers)


SYSTEM_BODY = json.dumps(chat({"role": "System", "content": W}, user(), max_tokens=1)).encode()


def test_the_issue_body_renders_215_tokens_on_sglang() -> None:
    assert sglang.count(load_model("qwen-3"), "chat", SYSTEM_BODY).tokens == 215


async def test_the_system_role_body_is_refused_with_a_50_token_pool_and_never_forwarded() -> None:
    async with served("qwen-3", 50) as srv:
        status, _ = await _post(srv, "chat", SYSTEM_BODY)
        forwarded = len(srv.upstream.bodies)
    assert forwarded == 0, f"forwarded with status {status}"
    assert status == 400


# Bodies whose decision the server and the adapter must agree on (admitted or refused, and
# the number in X-Kvproxy-Prompt-Tokens), one refused and one admitted at least.
AGREE = ["plain-chat", "role-System", "tool-strict-defer", "reasoning-effort-none"]


# A pool that holds the plain chat (228 tokens, counted exactly) and none of the others,
# which are decided by their guaranteed bounds (thousands of tokens).
AGREE_POOL = 240


async def test_the_adapter_decides_as_kvproxy_serve_does() -> None:
    """The adapter runs its own event loop: here it runs in a worker thread."""
    side = None
    try:
        async with served("qwen-3", AGREE_POOL) as srv:
            side = await asyncio.to_thread(
                KvproxySide, load_model("qwen-3").directory, "sglang", engines=_static(AGREE_POOL)
            )
            seen = set()
            for name in AGREE:
                body = BY_NAME[name].bytes()
                d = await asyncio.to_thread(side.decide, "chat", body, srv.limit_tokens)
                before = len(srv.upstream.bodies)
                status, headers = await _post(srv, "chat", body)
                forwarded = len(srv.upstream.bodies) - before
                assert (status == 200) == d.admitted, (name, status, d)
                assert forwarded == int(d.admitted), (name, forwarded, d)
                assert headers.get("X-Kvproxy-Prompt-Tokens") == str(d.tokens), (name, headers, d)
                seen.add(d.admitted)
            assert seen == {True, False}, "no admitted and refused pair among the bodies"
    finally:
        if side is not None:
            await asyncio.to_thread(side.close)
