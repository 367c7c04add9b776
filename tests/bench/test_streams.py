"""The streams-at-scale phase's own arithmetic: lost-stream detection, event counting across
reads, the histogram's p99, the per-step figures, the ramp's stop and the kvproxy/bare
ratio. Judged on counts only: no timing, no server.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
import scrape  # noqa: E402
import streams  # noqa: E402
from stream_client import Histogram, Run, StreamProtocol, Tally, lost_reason  # noqa: E402


def _whole(events: int = 5) -> Tally:
    return Tally(sent_at=1.0, first_at=1.05, last_at=1.3, events=events, max_gap_s=0.06,
                 status=200, done=True)  # fmt: skip


def test_a_stream_is_lost_when_it_errs_stalls_or_ends_short() -> None:
    assert lost_reason(_whole(), 5, 1.0) is None
    t = _whole()
    t.error = "ConnectionResetError"
    assert lost_reason(t, 5, 1.0) == "error"
    t = _whole()
    t.status = 503
    assert lost_reason(t, 5, 1.0) == "status 503"
    t = _whole()
    t.status = 0
    assert lost_reason(t, 5, 1.0) == "no answer"
    t = _whole()
    t.max_gap_s = 1.2
    assert lost_reason(t, 5, 1.0) == "stalled"
    # Closed before [DONE], or [DONE] after fewer (or more) events than the upstream sent.
    t = _whole()
    t.done = False
    assert lost_reason(t, 5, 1.0) == "ended early"
    assert lost_reason(_whole(events=4), 5, 1.0) == "ended early"
    assert lost_reason(_whole(events=6), 5, 1.0) == "ended early"


class _Transport:
    def __init__(self) -> None:
        self.closed = False
        self.sent = b""

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_the_client_counts_events_split_anywhere_and_sees_the_end() -> None:
    events = [b'data: {"i":%d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
    wire = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n" + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"
    )
    for cut in range(1, len(wire)):
        run = Run(expected=4, pace_s=0.05, window=(0.0, float("inf")))
        t = Tally()
        proto = StreamProtocol(run, t, b"GET")
        tr = _Transport()
        proto.connection_made(tr)  # type: ignore[arg-type]
        proto.data_received(wire[:cut])
        proto.data_received(wire[cut:])
        assert (t.status, t.events, t.done, tr.closed) == (200, 4, True, True), cut
        assert lost_reason(t, 4, 1.0) is None, cut
        assert run.window_events == 4, cut


def test_a_refusal_is_counted_as_a_lost_stream_and_closed() -> None:
    run = Run(expected=4, pace_s=0.05, window=(0.0, float("inf")))
    t = Tally()
    proto = StreamProtocol(run, t, b"GET")
    tr = _Transport()
    proto.connection_made(tr)  # type: ignore[arg-type]
    proto.data_received(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}")
    assert tr.closed
    assert t.events == 0
    assert lost_reason(t, 4, 1.0) == "status 503"


def test_a_close_before_done_is_an_early_end() -> None:
    run = Run(expected=4, pace_s=0.05, window=(0.0, float("inf")))
    t = Tally()
    proto = StreamProtocol(run, t, b"GET")
    proto.connection_made(_Transport())  # type: ignore[arg-type]
    proto.data_received(b"HTTP/1.1 200 OK\r\n\r\n" + _chunk(b"data: {}\n\n"))
    proto.connection_lost(None)
    assert lost_reason(t, 4, 1.0) == "ended early"
    t2 = Tally()
    reset = StreamProtocol(run, t2, b"GET")
    reset.connection_made(_Transport())  # type: ignore[arg-type]
    reset.data_received(b"HTTP/1.1 200 OK\r\n\r\n" + _chunk(b"data: {}\n\n"))
    reset.connection_lost(ConnectionResetError())
    assert lost_reason(t2, 4, 1.0) == "error"


def test_histogram_p99_is_the_upper_edge_of_the_bin_holding_the_rank() -> None:
    h = Histogram()
    for _ in range(98):
        h.add_ms(0.2)  # bin 0: [0, 0.5)
    h.add_ms(12.3)  # bin 24: [12, 12.5)
    h.add_ms(40.0)
    assert h.quantile_ms(0.99) == 12.5
    assert h.quantile_ms(0.5) == 0.5
    assert h.quantile_ms(1.0) == 40.5
    # Negative lateness (an event early after a late one) lands in the first bin.
    h.add_ms(-3.0)
    assert h.bins[0] == 99
    merged = Histogram.from_json(h.as_json())
    merged.merge(h)
    assert merged.count == 2 * h.count
    assert merged.bins[24] == 2
    assert Histogram().quantile_ms(0.99) is None


def _client_out(streams_n: int, events: int, lost: dict[str, int], late: list[float]) -> Any:
    h = Histogram()
    for ms in late:
        h.add_ms(ms)
    return {"streams": streams_n, "window_events": events, "lost": lost,
            "late": h.as_json(), "first": Histogram().as_json(), "max_gap_ms": 60.0}  # fmt: skip


def test_client_processes_merge_into_one_tally() -> None:
    got = streams.merge_clients(
        [
            _client_out(1000, 160_000, {}, [1.0] * 99 + [30.0]),
            _client_out(1000, 159_000, {"stalled": 2}, [1.0] * 100),
        ]
    )
    assert got["streams"] == 2000
    assert got["window_events"] == 319_000
    assert got["lost"] == {"stalled": 2}
    assert got["late"].count == 200


def _step(n: int, *, lost: int = 0, lag: float | None = 5.0, late: float = 3.0,
          load: float = 0.5, cpu: float = 10.0) -> dict[str, Any]:  # fmt: skip
    s: dict[str, Any] = {"streams": n, "lost": lost, "late_p99_ms": late, "load_cpu_share": load,
                         "cpu_us_per_event": cpu}  # fmt: skip
    if lag is not None:
        s["lag_p99_ms"] = lag
    return s


def test_step_figures_divide_cpu_by_events_and_memory_by_streams() -> None:
    # 2,000 streams for 8 s at 20 events/s = 320,000 events planned, 316,000 received.
    # Loop lag: rank 990 of 1,000 lies halfway into the (10, 20] ms bucket.
    lag = scrape.HistDelta(((0.005, 900.0), (0.01, 980.0), (0.02, 1000.0), (float("inf"), 1000.0)),
                           1000.0, 2.0)  # fmt: skip
    clients = streams.merge_clients([_client_out(2000, 316_000, {}, [1.0] * 100)])
    fig = streams.step_figures(
        n=2000,
        window_s=8.0,
        clients=clients,
        target_cpu_s=3.16,
        load_cpu_s={"upstream": 2.0, "clients": 4.0},
        rss_idle_kib=200 * 1024,
        rss_kib=200 * 1024 + 2000 * 30,
        lag=lag,
    )
    assert fig["cpu_us_per_event"] == pytest.approx(10.0)
    assert fig["delivered_share"] == pytest.approx(316_000 / 320_000, abs=1e-3)
    assert fig["rss_kib_per_stream"] == pytest.approx(30.0)
    assert fig["load_cpu_share"] == pytest.approx(0.75)
    assert fig["lag_p99_ms"] == pytest.approx(15.0)
    assert fig["late_p99_ms"] == 1.5
    assert fig["lost"] == 0


def test_the_ramp_stops_at_the_first_step_that_lags_loses_or_saturates_the_load() -> None:
    assert streams.step_verdict(_step(500)) == "ok"
    assert streams.step_verdict(_step(500, lag=25.0)) == "lag"
    # The bare forwarder has no loop-lag metric: the clients' lateness judges it.
    assert streams.step_verdict(_step(500, lag=None, late=21.0)) == "lag"
    assert streams.step_verdict(_step(500, lag=None, late=19.5)) == "ok"
    assert streams.step_verdict(_step(500, lost=1)) == "lost"
    assert streams.step_verdict(_step(500, load=0.95, lag=40.0)) == "load"
    ok = [_step(500), _step(1000), _step(2000)]
    assert streams.capacity(ok) == {"streams": 2000, "bound": "plan", "failed_at": None}
    assert streams.capacity([*ok, _step(4000, lag=31.0)]) == {
        "streams": 2000, "bound": "lag", "failed_at": 4000}  # fmt: skip
    assert streams.capacity([_step(500), _step(1000, lost=3)])["streams"] == 500
    assert streams.capacity([_step(500, lost=1)])["streams"] == 0
    assert streams.capacity([*ok, _step(4000, load=0.97)])["bound"] == "load"


def test_the_headline_ratio_and_verdicts_come_from_the_2000_stream_steps() -> None:
    st = {
        "bare": {"steps": [_step(500, cpu=9.0), _step(2000, cpu=10.0)],
                 "capacity": {"streams": 4000, "bound": "lag", "failed_at": 8000}},
        "kvproxy": {"steps": [_step(500, cpu=10.0), _step(2000, cpu=12.0, lost=0)],
                    "capacity": {"streams": 2000, "bound": "lag", "failed_at": 4000}},
    }  # fmt: skip
    assert streams.ratio_at(st, 2000) == pytest.approx(1.2)
    assert streams.ratio_at(st, 1000) is None
    # Both held 500 (bare also 2,000, kvproxy not): there the ratio is 10 / 9.
    st["bare"]["steps"][0]["verdict"] = st["kvproxy"]["steps"][0]["verdict"] = "ok"
    st["bare"]["steps"][1]["verdict"] = "ok"
    st["kvproxy"]["steps"][1]["verdict"] = "lag"
    assert streams.both_held(st) == 500
    held = {v["goal"]: v for v in report.judge({"streams": st})}[
        "streams: CPU per chunk kvproxy / bare at the largest count both held"
    ]
    assert held["value"] == pytest.approx(10 / 9)
    assert held["note"] == "500 streams"
    verdicts = {v["goal"]: v for v in report.judge({"streams": st})}
    ratio = verdicts["streams: CPU per chunk kvproxy / bare at 2,000 streams"]
    assert (ratio["value"], ratio["verdict"]) == (pytest.approx(1.2), "PASS")
    assert verdicts["streams lost at 2,000 (kvproxy)"]["verdict"] == "PASS"
    cap = verdicts["streams: capacity of kvproxy (lag p99 ≤ 20 ms, none lost)"]
    assert cap["value"] == 2000
    assert "4,000" in cap["note"]
    st["kvproxy"]["steps"][1]["lost"] = 7
    st["kvproxy"]["steps"][1]["cpu_us_per_event"] = 14.0
    verdicts = {v["goal"]: v for v in report.judge({"streams": st})}
    assert verdicts["streams lost at 2,000 (kvproxy)"]["verdict"] == "MISS"
    assert verdicts["streams: CPU per chunk kvproxy / bare at 2,000 streams"]["verdict"] == "MISS"
    # A run that never reached 2,000 streams (--tiny) says n/a, not PASS.
    tiny = {"bare": {"steps": [_step(100)]}, "kvproxy": {"steps": [_step(100)]}}
    verdicts = {v["goal"]: v for v in report.judge({"streams": tiny})}
    assert verdicts["streams lost at 2,000 (kvproxy)"]["verdict"] == "n/a"


def test_each_stream_lasts_past_the_window_whatever_the_step() -> None:
    for plan in streams.PLANS.values():
        for n in plan.steps:
            s = streams.Schedule.make(100.0, n, plan, streams.PACE_MS / 1e3)
            # The last stream opens at start + ramp, before the window; the first one still
            # has events to send at the window's end.
            assert s.start + s.ramp_s < s.window[0]
            assert s.start + (s.events - 2) * streams.PACE_MS / 1e3 > s.window[1]
            assert s.deadline > s.start + s.ramp_s + s.events * streams.PACE_MS / 1e3


def test_report_section_renders_every_step_and_the_capacities() -> None:
    st = {
        "plan": {"steps": [500, 2000], "window_s": 3.0, "settle_s": 1.0, "client_procs": 1},
        "pace_ms": 50.0,
        "fd_limit": 20000,
        "bare": {"steps": [{**_step(2000), "events_per_s": 39000.0, "verdict": "ok",
                            "lost_by_reason": {}}],
                 "capacity": {"streams": 2000, "bound": "plan", "failed_at": None}},
        "kvproxy": {"steps": [{**_step(2000, lost=2), "events_per_s": 38000.0,
                               "verdict": "lost", "lost_by_reason": {"stalled": 2}}],
                    "capacity": {"streams": 0, "bound": "lost", "failed_at": 2000}},
    }  # fmt: skip
    lines = report.streams_section({"streams": st})
    rows = [x for x in lines if x.startswith("| bare") or x.startswith("| kvproxy")]
    assert len(rows) == 2
    assert "{'stalled': 2}" in rows[1]
    assert any("kvproxy / bare = 1.00×" in x for x in lines)
    assert any("Capacity of kvproxy: 0 streams (streams lost at 2,000 streams)" in x for x in lines)


def test_the_paced_upstream_sends_max_tokens_events_then_done() -> None:
    import sse_upstream

    async def scenario() -> list[bytes]:
        sse_upstream.PacedUpstream.prepare(0.001, 8)
        proto = sse_upstream.PacedUpstream()
        tr = _Transport()
        proto.connection_made(tr)  # type: ignore[arg-type]
        body = b'{"stream":true,"max_tokens":5}'
        proto.data_received(b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(200):
            if tr.sent.endswith(b"0\r\n\r\n"):
                break
            await asyncio.sleep(0.005)
        return tr.sent.split(b"\r\n\r\n", 1)[1].split(b"\n\n")

    parts = asyncio.run(scenario())
    events = [p for p in parts if b"data: " in p]
    assert len(events) == 5
    assert b"[DONE]" in events[-1]
    assert b'"usage"' in events[-2]
