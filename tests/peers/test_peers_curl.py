"""`curl` as an SSE client of kvproxy in front of the PD simulator.

curl is the tool operators reach for first; `-N` turns off its output buffering so events
arrive as they are sent. curl runs as a subprocess (asyncio's, so the loop keeps serving
the proxy and the simulator) and is killed by pid only, never by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil

import aiohttp
import orjson
import pytest
from clients_support import MODEL, OVER_LIMIT_TEXT, proxy_before_sim, routed, sim_stats
from kvtest import wait_until

CURL = shutil.which("curl")
pytestmark = pytest.mark.skipif(CURL is None, reason="curl is not installed")
CHAT = "/v1/chat/completions"


def _curl_args(url: str, body: bytes, *extra: str) -> list[str]:
    assert CURL is not None
    return [
        CURL,
        "-sS",
        "-N",
        "--max-time",
        "60",  # a hung proxy fails the test instead of hanging it
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        "@-",
        *extra,
        url,
    ]


async def _curl(url: str, body: bytes, *extra: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *_curl_args(url, body, *extra),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(body), 90)
    assert proc.returncode is not None
    return proc.returncode, out, err


def _events(raw: bytes) -> list[bytes]:
    return [line[len(b"data: ") :] for line in raw.splitlines() if line.startswith(b"data: ")]


def _chat(content: str, **extra: object) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    )


async def test_curl_streams_sse_to_done() -> None:
    async with proxy_before_sim() as (proxy, _sim):
        rc, out, err = await _curl(
            proxy.public_url + CHAT, _chat("stream to me", stream=True, max_tokens=16), "-i"
        )
        assert rc == 0, err
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"content-type: text/event-stream" in head.lower()
        assert b"x-kvproxy-decision: admitted" in head.lower()
        events = _events(body)
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text
        # /generate streams SGLang's own SSE through the proxy as well.
        gen = orjson.dumps(
            {"text": "stream", "stream": True, "sampling_params": {"max_new_tokens": 8}}
        )
        rc, out, err = await _curl(proxy.public_url + "/generate", gen)
        assert rc == 0, err
        assert _events(out)[-1] == b"[DONE]"
        assert await wait_until(lambda: proxy.state.inflight == 0)


async def test_curl_sees_rejection_json(http: aiohttp.ClientSession) -> None:
    async with proxy_before_sim() as (proxy, sim):
        rc, out, err = await _curl(
            proxy.public_url + CHAT,
            _chat(OVER_LIMIT_TEXT, stream=True),
            "-w",
            "\n%{http_code}",
        )
        assert rc == 0, err
        body, _, code = out.rpartition(b"\n")
        assert code == b"400"
        error = orjson.loads(body)["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["prompt_tokens"] > error["limit_tokens"]
        # /generate gets SGLang's native error shape, with our code in a header.
        gen = orjson.dumps({"text": OVER_LIMIT_TEXT, "stream": True})
        rc, out, err = await _curl(proxy.public_url + "/generate", gen, "-w", "\n%{http_code}")
        body, _, code = out.rpartition(b"\n")
        assert code == b"400"
        native = orjson.loads(body)
        assert list(native) == ["error"]
        assert "accepts at most" in native["error"]["message"]
        assert routed(await sim_stats(http, sim)) == 0


async def test_curl_killed_mid_stream_is_a_counted_deferred_cancel(
    http: aiohttp.ClientSession,
) -> None:
    # A slow decode keeps the stream going long after curl is killed; nothing is timed.
    async with proxy_before_sim(sim_options={"decode_ms_per_token": 20.0}) as (proxy, sim):
        body = _chat("a long answer please", stream=True, max_tokens=4000)
        proc = await asyncio.create_subprocess_exec(
            *_curl_args(proxy.public_url + CHAT, body),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.write(body)
            await proc.stdin.drain()
            proc.stdin.close()
            seen_token = False
            for _ in range(200):  # bounded: events until one carries generated text
                line = await asyncio.wait_for(proc.stdout.readline(), 30)
                if line.startswith(b"data: {"):
                    chunk = orjson.loads(line[len(b"data: ") :])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        seen_token = True
                        break
            assert seen_token
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        assert await wait_until(lambda: proxy.state.inflight == 0, 30)
        m = proxy.metrics
        assert m.client_disconnects.labels("streaming", "default")._value.get() == 1
        # A token had reached the client: the transfer was over, so closing at once is safe.
        assert m.deferred_total.labels("first_token", "default")._value.get() == 1
        assert m.deferred_in_progress.labels("default")._value.get() == 0
        stats = await sim_stats(http, sim)
        assert stats["decode"]["late_writes_into_reallocated_pages"] == 0
