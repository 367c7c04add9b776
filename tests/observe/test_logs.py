"""I8: prompts and completions never reach a log line; the access log has one JSON line per
request with sizes, ids, decisions and reasons."""

from __future__ import annotations

import io
import json
import logging
import threading

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy

from kvproxy.observe.logs import JsonFormatter

SECRET_PROMPT = "tenant-secret-prompt-4f1c"
SECRET_REPLY = "tenant-secret-completion-9a2e"


@pytest.fixture
def captured() -> io.StringIO:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield buf  # type: ignore[misc]
    root.removeHandler(handler)
    root.setLevel(old_level)


async def test_no_prompt_or_completion_text_in_any_log_line(
    upstream: FakeUpstream, http: aiohttp.ClientSession, captured: io.StringIO
) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": SECRET_REPLY}}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    upstream.route("POST", "/v1/chat/completions", reply)
    await upstream.start()
    async with running_proxy(upstream.url, access_log=True) as proxy:
        for content, stream in ((SECRET_PROMPT, True), (SECRET_PROMPT * 20_000, False)):
            body = {
                "model": "m",
                "stream": stream,
                "messages": [{"role": "user", "content": content}],
            }
            async with http.post(
                proxy.public_url + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"Authorization": "Bearer sk-live-secret-token"},
            ) as resp:
                await resp.read()
        # Invalid JSON that quotes the secret must not echo it back into a log either.
        async with http.post(
            proxy.public_url + "/v1/chat/completions",
            data=b'{"messages": "' + SECRET_PROMPT.encode(),
        ) as resp:
            assert resp.status == 400
            assert SECRET_PROMPT not in await resp.text()
    text = captured.getvalue()
    assert SECRET_PROMPT not in text
    assert SECRET_REPLY not in text
    assert "sk-live-secret-token" not in text
    access = [json.loads(line) for line in text.splitlines() if '"kvproxy.access"' in line]
    assert len(access) == 3
    first = access[0]
    assert first["route"] == "chat"
    assert (first["method"], first["path"]) == ("POST", "/v1/chat/completions")
    assert len(first["request_id"]) == 32
    assert first["duration_s"] > 0
    assert first["decision"] == "admitted"
    assert first["status"] == 200
    assert first["bytes_in"] > 0
    assert first["bytes_out"] > 0
    assert first["prompt_tokens"] > 0
    assert access[1]["decision"] == "rejected"
    assert access[1]["reason"] == "context_length"
    assert access[2]["reason"] == "invalid_request"


async def test_engine_counting_more_than_the_proxy_is_flagged(
    upstream: FakeUpstream, http: aiohttp.ClientSession, captured: io.StringIO
) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 10_000}}
        )

    upstream.route("POST", "/v1/chat/completions", reply)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        body = {"model": "m", "messages": [{"role": "user", "content": "short"}]}
        async with http.post(proxy.public_url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        assert proxy.metrics.token_bound_exceeded.labels("default")._value.get() == 1
    assert "tokenizer does not match the model" in captured.getvalue()


def _own_logger(name: str, stream: io.StringIO) -> tuple[logging.Logger, logging.Handler]:
    """A logger whose only handler is kvproxy's JSON handler on `stream` (no propagation):
    the configuration under which emit_access writes the line itself."""
    from kvproxy.observe.logs import JsonStreamHandler

    handler = JsonStreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger(name)
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return log, handler


def test_the_direct_access_line_is_the_line_logging_would_write() -> None:
    from kvproxy.observe.logs import _only_json_handler, emit_access

    buf = io.StringIO()
    log, handler = _own_logger("kvproxy.access.direct-test", buf)
    fields = {"request_id": "r1", "method": "POST", "path": "/v1/x", "route": "chat",
              "status": 200, "reason": None, "prompt_tokens": 12, "ttft_s": 0.25,
              "deferred_s": None}  # fmt: skip
    names, values = tuple(fields), tuple(fields.values())
    try:
        assert _only_json_handler(log) is handler
        emit_access(log, names, values)  # direct
        log.addFilter(lambda r: True)  # any filter: the record must go through logging
        assert _only_json_handler(log) is None
        emit_access(log, names, values)
        direct, logged = (json.loads(line) for line in buf.getvalue().splitlines())
        direct.pop("ts")
        logged.pop("ts")
        assert direct == logged
        # A None value is left out of the line, on both paths; the rest keep their order.
        assert list(logged) == ["level", "logger", "msg", "request_id", "method", "path",
                                "route", "status", "prompt_tokens", "ttft_s"]  # fmt: skip
        assert logged["request_id"] == "r1"
        assert logged["msg"] == "request"
        # A second handler anywhere on the way (a test's capture, an operator's file) also
        # sends the record through logging, so every handler gets it.
        log.filters.clear()
        other = logging.StreamHandler(io.StringIO())
        log.addHandler(other)
        assert _only_json_handler(log) is None
    finally:
        log.handlers.clear()
        log.filters.clear()
        log.propagate = True


async def test_access_lines_of_one_loop_iteration_are_written_together_and_in_order() -> None:
    import asyncio

    from kvproxy.observe.logs import PENDING_LINES, emit_access

    class Counting(io.StringIO):
        writes = 0

        def write(self, s: str) -> int:
            self.writes += 1
            return super().write(s)

    buf = Counting()
    log, handler = _own_logger("kvproxy.access.batch-test", buf)
    loop = asyncio.get_running_loop()
    names = ("request_id", "status")
    try:
        for i in range(3):
            emit_access(log, names, (f"r{i}", 200), loop)
        assert buf.getvalue() == ""  # held until the loop iteration ends
        await asyncio.sleep(0)
        assert [json.loads(x)["request_id"] for x in buf.getvalue().splitlines()] == [
            "r0", "r1", "r2"
        ]  # fmt: skip
        assert buf.writes == 1
        # Any other record writes the waiting lines first: the stream keeps the order.
        emit_access(log, names, ("r3", 200), loop)
        log.warning("after r3")
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert [x.get("request_id", x["msg"]) for x in lines[3:]] == ["r3", "after r3"]
        # So does a flush (logging.shutdown flushes every handler at exit).
        emit_access(log, names, ("r4", 200), loop)
        handler.flush()
        assert json.loads(buf.getvalue().splitlines()[-1])["request_id"] == "r4"
        # Memory stays bounded: a full batch is written without waiting for the loop.
        before = buf.writes
        for i in range(PENDING_LINES + 2):
            emit_access(log, names, (f"b{i}", 200), loop)
        assert buf.writes == before + 1  # the first PENDING_LINES, at once
        await asyncio.sleep(0)
        assert buf.writes == before + 2  # the last, at the end of the iteration
        assert len(buf.getvalue().splitlines()) == 6 + PENDING_LINES + 2
        # A record from another thread (a worker's warning) writes the waiting lines first.
        emit_access(log, names, ("r5", 200), loop)
        worker = threading.Thread(target=log.warning, args=("from a worker",))
        worker.start()
        worker.join()
        assert [json.loads(x).get("request_id") for x in buf.getvalue().splitlines()[-2:]] == [
            "r5", None
        ]  # fmt: skip
        # Without a loop the line is written at once.
        emit_access(log, names, ("now", 200))
        assert json.loads(buf.getvalue().splitlines()[-1])["request_id"] == "now"
    finally:
        log.handlers.clear()
        log.propagate = True


def test_a_failing_log_stream_never_raises_into_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvproxy.observe.logs import JsonStreamHandler

    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError("reader gone")

    monkeypatch.setattr(logging, "raiseExceptions", False)
    handler = JsonStreamHandler(Broken())
    handler.write_soon('{"msg":"request"}\n', None)  # must not raise
    handler.flush()
