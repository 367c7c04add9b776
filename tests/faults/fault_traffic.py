"""Mixed client traffic for the fault suite, and how each reply is judged from the wire alone.

A request is chat, completions or /generate, streamed or not, from one of two tenants whose
prompts carry their canary markers; some are over the engines' limit (kvproxy must refuse
them), some clients leave during prefill. Every reply ends as one of:

    ok            a 200 whose body is a complete answer (JSON with choices/text; an event
                  stream ended by [DONE])
    failure       an explicit one: a non-200 status, a stream ended by an error event, or a
                  connection closed before the response's framing completed ("cut")
    left          the client went away on purpose
    broken        a well-framed 200 whose body is not a complete answer      (violation)
    hang          no end within the bound the configured timeouts give    (violation)

Text is never printed: outcomes carry statuses, codes and tenants only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
# A whole marker only: the simulator's replies echo pieces of the prompt, and a piece cut
# right after "KVCANARY-canary-" followed by the next word would read as another tenant.
MARKER_RE = re.compile(r"KVCANARY-(canary-[a-z])-[0-9a-f]{16}")
TENANTS = ("canary-a", "canary-b")
# Every request id of this session carries it: the simulator's router remembers every id it
# saw (a reset does not forget them), so an id reused by a later run, or by the next
# session against the same simulator, would read as a request sent upstream twice.
RUN = os.urandom(4).hex()
_SERIAL = itertools.count()


def request_id(tag: str) -> str:
    return f"faults-{RUN}-{tag}-{next(_SERIAL)}"


# The simulator's context is 8,192 tokens (one per byte here); above it kvproxy refuses.
OVER_LIMIT_BYTES = 9000


@dataclass
class Spec:
    path: str
    stream: bool
    prompt_bytes: int
    max_tokens: int
    tenant: str
    leave_after_s: float | None = None  # the client leaves this long after sending


@dataclass
class Outcome:
    spec: Spec
    rid: str
    started: float
    ended: float
    kind: str  # ok | failure | left | broken | hang
    label: str  # e.g. "200", "502 upstream_reset", "200+error upstream_timeout", "cut"
    foreign: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.ended - self.started


def tenant_prompt(tenant: str, n_bytes: int, rng: random.Random) -> str:
    line = f"tenant {tenant} secret KVCANARY-{tenant}-{rng.getrandbits(64):016x}. "
    tail = " please repeat your context"
    return (line * (n_bytes // len(line) + 1))[: max(0, n_bytes - len(tail))] + tail


def body(spec: Spec, rng: random.Random) -> dict[str, Any]:
    prompt = tenant_prompt(spec.tenant, spec.prompt_bytes, rng)
    if spec.path == GENERATE:
        return {
            "text": prompt,
            "stream": spec.stream,
            "sampling_params": {"max_new_tokens": spec.max_tokens},
        }
    if spec.path == COMPLETIONS:
        return {"model": "kvproxy-sim", "prompt": prompt, "stream": spec.stream,
                "max_tokens": spec.max_tokens}  # fmt: skip
    return {"model": "kvproxy-sim", "messages": [{"role": "user", "content": prompt}],
            "stream": spec.stream, "max_tokens": spec.max_tokens}  # fmt: skip


def mix(
    rng: random.Random,
    n: int,
    *,
    leave: float = 0.15,
    over: float = 0.08,
    prompt: tuple[int, int] = (1000, 2500),
    max_tokens: tuple[int, int] = (40, 120),
) -> list[Spec]:
    """`n` requests: every route, streamed or not, two tenants; a share of clients that
    leave during prefill, and a share of prompts over the limit."""
    out = []
    for i in range(n):
        path = (CHAT, COMPLETIONS, GENERATE)[i % 3]
        spec = Spec(
            path=path,
            stream=rng.random() < 0.6,
            prompt_bytes=rng.randint(*prompt),
            max_tokens=rng.randint(*max_tokens),
            tenant=TENANTS[i % 2],
        )
        r = rng.random()
        if r < over:
            spec.prompt_bytes = OVER_LIMIT_BYTES
        elif r < over + leave:
            spec.leave_after_s = rng.uniform(0.2, 0.6)
        out.append(spec)
    return out


def _texts(obj: Any) -> str:
    if not isinstance(obj, dict):
        return ""
    if isinstance(obj.get("text"), str) and "choices" not in obj:
        return str(obj["text"])
    parts = []
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            for part in (choice.get("delta"), choice.get("message")):
                if isinstance(part, dict) and isinstance(part.get("content"), str):
                    parts.append(part["content"])
            if isinstance(choice.get("text"), str):
                parts.append(choice["text"])
    return "".join(parts)


def judge_reply(status: int, content_type: str, raw: bytes) -> tuple[str, str, str]:
    """(kind, label, text) of a reply that arrived with complete framing."""
    if status != 200:
        code = ""
        try:
            err = json.loads(raw)
            inner = err.get("error", err) if isinstance(err, dict) else {}
            code = (
                str(inner.get("code") or inner.get("type") or "") if isinstance(inner, dict) else ""
            )
        except (ValueError, UnicodeDecodeError):
            pass
        return "failure", f"{status} {code}".strip(), ""
    if content_type.startswith("text/event-stream"):
        text, done, error = [], False, ""
        for line in raw.decode("utf-8", "replace").splitlines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                return "broken", "200 undecodable event", ""
            if isinstance(obj, dict) and "error" in obj:
                inner = obj["error"] if isinstance(obj["error"], dict) else obj
                error = str(inner.get("code") or inner.get("type") or "error")
            text.append(_texts(obj))
        if error:
            return "failure", f"200+error {error}", "".join(text)
        if done:
            return "ok", "200", "".join(text)
        return "broken", "200 stream without end", "".join(text)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return "broken", "200 undecodable body", ""
    if not isinstance(obj, dict) or ("choices" not in obj and "text" not in obj):
        return "broken", "200 without an answer", ""
    return "ok", "200", _texts(obj)


@dataclass
class Progress:
    """What the traffic has reached so far (the triggers for a fault's phase)."""

    streaming: int = 0  # streamed replies that have delivered content
    sent: int = 0


async def one(
    http: aiohttp.ClientSession,
    base: str,
    spec: Spec,
    rng: random.Random,
    bound_s: float,
    progress: Progress,
    rid: str,
) -> Outcome:
    payload = body(spec, rng)
    started = time.monotonic()
    headers = {"X-Tenant-ID": spec.tenant, "X-Request-ID": rid}

    async def go() -> tuple[str, str, str]:
        try:
            async with http.post(base + spec.path, json=payload, headers=headers) as resp:
                chunks = []
                counted = False
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
                    if not counted and spec.stream and resp.status == 200 and b"data:" in chunk:
                        counted = True
                        progress.streaming += 1
                return judge_reply(
                    resp.status, resp.headers.get("Content-Type", ""), b"".join(chunks)
                )
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError):  # fmt: skip
            return "failure", "cut", ""

    task = asyncio.ensure_future(go())
    progress.sent += 1
    try:
        if spec.leave_after_s is not None:
            done, _ = await asyncio.wait({task}, timeout=spec.leave_after_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Outcome(spec, rid, started, time.monotonic(), "left", "left")
        async with asyncio.timeout(bound_s + 1.0):
            kind, label, text = await task
    except TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Outcome(spec, rid, started, time.monotonic(), "hang", "hang")
    except aiohttp.ClientError as exc:
        return Outcome(spec, rid, started, time.monotonic(), "failure", type(exc).__name__)
    foreign = sorted({t for t in MARKER_RE.findall(text) if t != spec.tenant})
    return Outcome(spec, rid, started, time.monotonic(), kind, label, foreign)


async def wave(
    base: str,
    specs: list[Spec],
    seed: int,
    bound_s: float,
    progress: Progress,
    spread_s: float = 0.5,
    tag: str = "r",
) -> list[Outcome]:
    """Send `specs` concurrently (spread over `spread_s`), each with its own id."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def later(i: int, spec: Spec) -> Outcome:
            await asyncio.sleep(spread_s * i / max(1, len(specs)))
            return await one(http, base, spec, random.Random(rng.random()), bound_s, progress,
                             request_id(f"{tag}-{seed}-{i}"))  # fmt: skip

        return list(await asyncio.gather(*(later(i, s) for i, s in enumerate(specs))))


async def probe_until_ok(base: str, timeout_s: float, every_s: float = 0.2) -> float | None:
    """Send a small request until one is answered 200 (bounded); returns when, or None."""
    rng = random.Random(0)
    spec = Spec(CHAT, False, 200, 4, TENANTS[0])
    progress = Progress()
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        for i in range(int(timeout_s / every_s) + 1):
            got = await one(http, base, spec, rng, 8.0, progress, request_id(f"probe-{i}"))
            if got.kind == "ok":
                return time.monotonic()
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(every_s)
    return None


def summary(outcomes: list[Outcome]) -> str:
    c = Counter(o.label for o in outcomes)
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))
