"""I1 in a closed world, with a real vLLM 0.32 engine as the oracle (`make test-real`).

`kvproxy serve` (its defaults; only the engine's URL given) runs in front of the session's
unified vLLM engine (tests/real/engines.py: tiny random-weight Qwen3, the real Qwen-3
tokenizer and template). Thousands of generated bodies, mutations over every field of
kvproxy's vLLM 0.32 chat and completions tables (kvproxy/prompt/fields.py), request
templates, tools and media included, go through kvproxy with max_tokens 1: each one kvproxy
admits reaches the engine, whose `usage.prompt_tokens` is the truth. It must find no
admitted body whose bound (X-Kvproxy-Prompt-Tokens) is below the engine's count, and none
admitted over the limit. The must-show cases check the engine's own counters: a refused body
never reached it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import struct
import sys
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

if os.environ.get("KVPROXY_REAL") != "1":  # the real suite's conftest ignores it too
    pytest.skip("real engines: make test-real", allow_module_level=True)

from engines import VllmEngine, wait_metrics
from kvtest import serve_ready
from ports import free_port

from kvproxy.prompt.fields import VLLM_0_32

pytestmark = pytest.mark.real

CORPUS = int(os.environ.get("KVPROXY_CLOSED_CORPUS", "5000"))
CONCURRENCY = 6
# Sent to kvproxy's gate but never generated with: vLLM 0.32's CPU build dies on a per-request
# `seed` ("CPU Generator does not use offset", EngineCore fatal), and beam search is minutes
# per request here. The gate's answer to them is checked without the engine (tests/prompt).
NOT_GENERATED = frozenset({"seed", "use_beam_search"})
READY_TIMEOUT_S = 120.0


@dataclass
class Proxy:
    url: str
    limit: int


@contextlib.asynccontextmanager
async def kvproxy_serve(engine: VllmEngine, **extra: Any) -> AsyncIterator[Proxy]:
    """`kvproxy serve` in front of `engine`, with defaults beyond the URLs (and `extra`); its
    log goes to a file beside the engine's (a pipe nobody reads would fill and block it)."""
    port, admin = free_port(), free_port()
    log = engine.logs / f"kvproxy-closed-{port}.log"
    settings: dict[str, Any] = {
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{admin}",
        "upstream": engine.url,
        "engines": [{"url": engine.url, "role": "unified", "kind": "vllm"}],
        **extra,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    for key, value in settings.items():
        env[f"KVPROXY_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    with log.open("ab") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvproxy",
            "serve",
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,
        )
    try:
        limit = await serve_ready(proc, admin, lambda: _tail(log), READY_TIMEOUT_S)
        yield Proxy(f"http://127.0.0.1:{port}", limit)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, 15)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                os.killpg(proc.pid, 9)
                await proc.wait()


async def _tail(log: Path) -> str:
    return (await asyncio.to_thread(log.read_text))[-2000:]


# --- the corpus -------------------------------------------------------------------------------

WORDS = ["alpha", "beta", "the", "KV", "cache", "é", "中文", "🙂", "\n", "{", "}", '"', "0.5"]
TEMPLATES = [
    "{% for i in range(3000) %}x {% endfor %}{{ messages[0]['content'] }}",
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{{ messages | tojson }}",
]


def png(w: int, h: int) -> bytes:
    """A whole, decodable PNG (the engine decodes it): w x h black RGB pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + b"\x00" * (3 * w) for _ in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


IMAGE_URL = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def value_for(rng: random.Random, name: str, kind: str) -> Any:
    """A plausible value for a field of the table (the engine may refuse it: fine)."""
    if name == "chat_template":
        return rng.choice(TEMPLATES)
    if name == "tools":
        return [
            {
                "type": "function",
                "function": {
                    "name": f"f{rng.randint(0, 9)}",
                    "description": text(rng, rng.randint(0, 40)),
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                },
            }
        ]
    if name == "tool_choice":
        return rng.choice(["auto", "none"])
    if name == "chat_template_kwargs":
        return rng.choice([{"enable_thinking": rng.random() < 0.5}, {"x": text(rng, 20)}])
    if name == "documents":
        return [{"title": text(rng, 3), "text": text(rng, rng.randint(1, 200))}]
    if name == "mm_processor_kwargs":
        return {"min_pixels": 47_040_000, "max_pixels": 47_040_000}
    if name in ("add_generation_prompt", "continue_final_message", "add_special_tokens", "echo"):
        return rng.random() < 0.5
    if name == "reasoning_effort":
        return rng.choice(["low", "medium", "high"])
    if name in ("temperature", "top_p"):
        return rng.random()
    if name in ("top_k", "n"):
        return 1
    if name in ("stop",):
        return [text(rng, 1)]
    if kind == "neutral":
        return None  # the field present, with its default: the engine accepts it
    return text(rng, rng.randint(0, 30))


def chat_body(rng: random.Random) -> dict[str, Any]:
    size = rng.choice([5, 50, 400, 2000, 5000])
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": text(rng, rng.randint(1, size))})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text(rng, rng.randint(1, size))})
        if rng.random() < 0.3:
            messages.append({"role": "assistant", "content": text(rng, rng.randint(1, 50))})
    messages.append({"role": "user", "content": text(rng, rng.randint(1, size))})
    if rng.random() < 0.05:
        messages[-1]["content"] = [
            {"type": "text", "text": text(rng, 5)},
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        ]
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 1}
    for name, kind in rng.sample(sorted(VLLM_0_32["chat"].items()), rng.randint(0, 4)):
        if name in ("messages", "model", "max_tokens", "stream", "n", "stream_options"):
            continue
        if name not in NOT_GENERATED:
            body[name] = value_for(rng, name, kind)
    if rng.random() < 0.03:
        body["made_up_field"] = text(rng, 3)
    return body


def completion_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": text(rng, rng.randint(1, rng.choice([10, 500, 4000]))),
        "max_tokens": 1,
    }
    for name, kind in rng.sample(sorted(VLLM_0_32["completions"].items()), rng.randint(0, 3)):
        if name in ("prompt", "model", "max_tokens", "stream", "n", "stream_options"):
            continue
        if name not in NOT_GENERATED:
            body[name] = value_for(rng, name, kind)
    return body


@dataclass
class Tally:
    sent: int = 0
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    engine_refused: int = 0
    under: list[str] = field(default_factory=list)
    over_limit: list[str] = field(default_factory=list)
    worst_ratio: float = 0.0


async def one(
    http: aiohttp.ClientSession, proxy: Proxy, path: str, body: dict[str, Any], tally: Tally
) -> None:
    async with http.post(proxy.url + path, json=body) as r:
        data = await r.read()
        tally.sent += 1
        if r.headers.get("X-Kvproxy-Decision") == "rejected" or (
            r.status >= 400 and "X-Kvproxy-Error-Code" in r.headers
        ):
            code = r.headers.get("X-Kvproxy-Error-Code", str(r.status))
            tally.refused[code] = tally.refused.get(code, 0) + 1
            return
        if r.status != 200:
            tally.engine_refused += 1  # forwarded; the engine refused it (a 4xx of its own)
            return
        tally.admitted += 1
        bound = int(r.headers["X-Kvproxy-Prompt-Tokens"])
        truth = int(json.loads(data)["usage"]["prompt_tokens"])
        keys = ",".join(sorted(body))
        if bound < truth:
            tally.under.append(f"{path} {keys}: bound {bound} < engine {truth}")
        if truth > proxy.limit:
            tally.over_limit.append(f"{path} {keys}: engine {truth} > limit {proxy.limit}")
        tally.worst_ratio = max(tally.worst_ratio, bound / max(truth, 1))


async def test_differential_no_admitted_under_count(vllm_unified: VllmEngine) -> None:
    rng = random.Random("closed-world")
    bodies = [
        ("/v1/chat/completions", chat_body(rng))
        if rng.random() < 0.8
        else ("/v1/completions", completion_body(rng))
        for _ in range(CORPUS)
    ]
    tally = Tally()
    started = time.monotonic()
    async with kvproxy_serve(vllm_unified) as proxy:
        sem = asyncio.Semaphore(CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def bounded(path: str, body: dict[str, Any]) -> None:
                async with sem:
                    await one(http, proxy, path, body, tally)

            await asyncio.gather(*(bounded(p, b) for p, b in bodies))
    took = time.monotonic() - started
    print(
        f"\nclosed world: {tally.sent} bodies in {took:.0f} s, {tally.admitted} admitted, "
        f"refused by kvproxy {tally.refused}, refused by the engine {tally.engine_refused}, "
        f"limit {proxy.limit}; max bound/truth {tally.worst_ratio:.2f}; "
        f"under-counts {len(tally.under)}, admitted over the limit {len(tally.over_limit)}"
    )
    assert tally.sent == CORPUS >= 5000 or "KVPROXY_CLOSED_CORPUS" in os.environ
    assert tally.admitted > CORPUS // 4  # the corpus exercises admission, not only refusals
    assert tally.under == []
    assert tally.over_limit == []


async def test_must_show_request_template_and_forced_image(
    vllm_unified: VllmEngine, tmp_path: Path
) -> None:
    before = vllm_unified.metrics()
    requests_before = before.value("vllm:request_success_total")
    template_body = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": TEMPLATES[0],
    }
    image_body = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}}]}
        ],
        "mm_processor_kwargs": {"min_pixels": 47_040_000, "max_pixels": 47_040_000},
    }
    # The model's processor configured (Qwen2.5-VL's numbers): the image is priced at
    # 60,025 tokens and refused against a 40,000-token declared context.
    config = tmp_path / "preprocessor_config.json"
    config.write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "patch_size": 14,
                "merge_size": 2,
                "min_pixels": 3136,
                "max_pixels": 12845056,
            }
        )
    )
    got: dict[str, tuple[int, dict[str, Any]]] = {}
    priced = 0
    async with aiohttp.ClientSession() as http:
        async with kvproxy_serve(vllm_unified) as proxy:
            for name, body in (("template", template_body), ("image", image_body)):
                async with http.post(proxy.url + "/v1/chat/completions", json=body) as r:
                    got[name] = (r.status, await r.json())
        async with kvproxy_serve(
            vllm_unified, media_processor=str(config), max_context=40_000
        ) as proxy:
            async with http.post(proxy.url + "/v1/chat/completions", json=image_body) as r:
                got["image+processor"] = (r.status, await r.json())
                priced = int(r.headers.get("X-Kvproxy-Prompt-Tokens", "0"))
    status, err = got["template"]
    assert status == 400
    assert err["error"]["code"] == "unsupported_field"
    assert err["error"]["param"] == "chat_template"
    status, err = got["image"]
    assert status == 400
    assert err["error"]["param"] == "image_url"  # no processor configured: refused by kind
    status, err = got["image+processor"]
    assert status == 400
    assert err["error"]["code"] == "context_length_exceeded"
    assert priced >= 60_025  # transformers: image_grid_thw [1, 490, 490], 490 * 490 / 4
    # None of them reached the engine.
    after = wait_metrics(vllm_unified, lambda m: True, "answered")
    assert after.value("vllm:request_success_total") == requests_before
    assert after.value("vllm:prompt_tokens_total") == before.value("vllm:prompt_tokens_total")
