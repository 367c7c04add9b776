"""The long-prompt phase's client and arithmetic (bench/long_concurrent.py), no timing: the
client counts every answer of a real HTTP/1.1 server (Content-Length and chunked, over one
keep-alive connection per client), `added` subtracts direct's figure, the report prints the
table and judges the targets."""

from __future__ import annotations

import sys
from pathlib import Path

from aiohttp import web
from kvtest import serving

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import long_concurrent  # noqa: E402
import report  # noqa: E402


async def test_client_reads_every_answer_on_keep_alive_connections() -> None:
    seen: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen.append(len(body))
        headers = {"X-Kvproxy-Prompt-Tokens-Kind": "exact"}
        if len(seen) % 2:
            return web.Response(body=b"x" * 5000, headers=headers)
        resp = web.StreamResponse(headers=headers)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"y" * 3000)
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", handler)
    async with serving(app) as url:
        body = b"z" * 600_000
        ttfbs, statuses, kinds = await long_concurrent._client(url, body, 9, 4)
    assert statuses == [200] * 9
    assert kinds == ["exact"] * 9
    assert len(ttfbs) == 9
    assert seen == [600_000] * 9


def test_added_is_minus_direct_and_the_report_judges_it() -> None:
    def cell(p50: float, p99: float) -> dict[str, object]:
        return {"requests": 16, "ttfb_ms_p50": p50, "ttfb_ms_p99": p99,
                "cpu_ms_per_prompt": 4.0, "statuses": [200], "kinds": ["exact"]}  # fmt: skip

    lc = {
        "direct": {"100k": {"1": cell(1.0, 2.0), "16": cell(10.0, 20.0), "peak_rss_mib": 6.0}},
        "kvproxy": {"100k": {"1": cell(4.0, 9.0), "16": cell(50.0, 90.0), "peak_rss_mib": 200.0}},
        "litellm": {"100k": {"1": cell(30.0, 60.0), "16": cell(500.0, 900.0)}},
    }
    long_concurrent.added(lc)
    assert lc["kvproxy"]["100k"]["16"]["added_ms_p99"] == 70.0
    assert lc["kvproxy"]["100k"]["1"]["added_ms_p50"] == 3.0
    verdicts = {v["goal"]: v for v in report.judge({"long_concurrent": lc})}
    assert (
        verdicts["~100k-token prompts at concurrency 16: kvproxy's added TTFB p99"]["verdict"]
        == "MISS"
    )
    ratio = verdicts["~100k-token prompts at concurrency 16: added p99, kvproxy / litellm"]
    assert ratio["value"] == 70.0 / 880.0
    assert ratio["verdict"] == "PASS"
    lines = report._concurrent_section({"long_concurrent": lc})
    assert any(line.startswith("| kvproxy | 100k | 16 | 16 |") for line in lines)
