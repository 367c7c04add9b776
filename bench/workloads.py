"""The workloads, each run against a started target, each returning plain figures.

Owns: correctness pre-checks (a target that answers wrongly is not measured), the small
chat POST (throughput at saturation, latency at concurrency 1), the SSE relay, long
prompts end to end, the mixed run (small requests while 4 MB prompts are counted) and
memory. CPU is the delta of /proc utime+stime of the target's processes over exactly the
wrk run. Must never: assert on speed (this is a benchmark, the report judges), or print
prompt text.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import procstat
import scrape
from payloads import API_KEY, long_chat_body, small_chat_body
from targets import Running
from wrk_driver import WrkResult, run_wrk

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Durations:
    """Seconds per phase; `--quick` shrinks them all (the figures get noisier, not wrong)."""

    warmup_s: float = 1.0
    throughput_s: float = 8.0
    latency_s: float = 5.0
    sse_s: float = 8.0
    mixed_s: float = 15.0
    connections: int = 32
    sse_connections: int = 16
    long_reps: int = 5


class WrongAnswer(RuntimeError):
    """A target answered, but not what the upstream sent: its figures would be meaningless."""


# --- one request, checked ---------------------------------------------------------------


def _conn(url: str, timeout_s: float) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout_s)


def _exchange(
    conn: http.client.HTTPConnection, body: bytes, tenant: str
) -> tuple[int, dict[str, str], bytes]:
    headers = {
        "Content-Type": "application/json",
        "X-Tenant-ID": tenant,
        "Authorization": f"Bearer {API_KEY}",
    }
    conn.request("POST", CHAT_PATH, body, headers)
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def post(
    url: str, body: bytes, *, tenant: str = "acme", timeout_s: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """One POST on a fresh connection: status, lower-cased headers, body."""
    conn = _conn(url, timeout_s)
    try:
        return _exchange(conn, body, tenant)
    finally:
        conn.close()


def _problem(status: int, headers: dict[str, str], data: bytes, chunks: int | None) -> str | None:
    if status != 200:
        return f"HTTP {status}"
    if chunks is None:
        try:
            reply = json.loads(data)
        except ValueError:
            return "reply is not JSON"
        if reply.get("choices", [{}])[0].get("message", {}).get("role") != "assistant":
            return "reply is not a chat completion"
        return None
    if not headers.get("content-type", "").startswith("text/event-stream"):
        return f"content type {headers.get('content-type')!r} for a stream"
    events = [e for e in data.split(b"\n\n") if e.startswith(b"data: ")]
    if len(events) != chunks or events[-1] != b"data: [DONE]":
        return f"{len(events)} SSE events, expected {chunks} ending in [DONE]"
    return None


def check(run: Running, *, chunks: int | None = None) -> str | None:
    """Two requests on one keep-alive connection, as wrk sends them.

    A wrong first answer raises `WrongAnswer` (the target is not measured). A wrong second
    answer is returned as a problem: the target is measured anyway (wrk then counts an
    error per request), and the report names the problem."""
    body = small_chat_body(stream=chunks is not None)
    conn = _conn(run.url, 30)
    try:
        first = _problem(*_exchange(conn, body, "acme"), chunks)
        if first is not None:
            raise WrongAnswer(f"{run.name}: {first}")
        try:
            second = _problem(*_exchange(conn, body, "globex"), chunks)
        except (http.client.HTTPException, OSError) as exc:
            second = f"{type(exc).__name__}"
    finally:
        conn.close()
    if second is None:
        return None
    kind = "SSE stream" if chunks is not None else "chat reply"
    return (
        f"{run.name}: the second request on a keep-alive connection, after a {kind}, got: {second}"
    )


# --- wrk with CPU accounting ------------------------------------------------------------


def measured_wrk(
    run: Running,
    body: bytes,
    *,
    duration_s: float,
    connections: int,
    delay_ms: int = 0,
    path: str = "/v1/chat/completions",
) -> tuple[WrkResult, float]:
    """One wrk run and the target's CPU seconds spent over it."""
    c0 = procstat.tree_cpu_s(run.pids)
    res = run_wrk(
        run.url,
        body,
        path=path,
        duration_s=duration_s,
        connections=connections,
        delay_ms=delay_ms,
    )
    c1 = procstat.tree_cpu_s(run.pids)
    return res, c1 - c0


def small_chat(run: Running, d: Durations) -> dict[str, Any]:
    """Saturating throughput with `connections`, then latency at concurrency 1."""
    problem = check(run)
    body = small_chat_body()
    if d.warmup_s > 0:
        run_wrk(run.url, body, duration_s=d.warmup_s, connections=d.connections)
    thr, cpu_s = measured_wrk(run, body, duration_s=d.throughput_s, connections=d.connections)
    # The tiny (smoke) mode skips the concurrency-1 run: its latency is then the saturated one.
    lat = thr
    if d.latency_s > 0:
        lat, _ = measured_wrk(run, body, duration_s=d.latency_s, connections=1)
    return {
        "rps": round(thr.rps, 1),
        "requests": thr.requests,
        "errors": thr.errors + (lat.errors if lat is not thr else 0),
        "cpu_s": round(cpu_s, 3),
        "cpu_us_per_req": round(cpu_s / thr.requests * 1e6, 2) if thr.requests else None,
        "p50_us_c1": lat.p50_us,
        "p99_us_c1": lat.p99_us,
        "p99_us_saturated": thr.p99_us,
        "wrk_errors": {k: v for k, v in thr.as_dict().items() if k.startswith("err_") and v},
        "problem": problem,
    }


def small_chat_cpu(run: Running, d: Durations, path: str) -> dict[str, Any]:
    """CPU per small chat POST only (no latency run), on `path`: the policy breakdown."""
    body = small_chat_body()
    if d.warmup_s > 0:
        run_wrk(run.url, body, path=path, duration_s=d.warmup_s, connections=d.connections)
    res, cpu_s = measured_wrk(
        run, body, path=path, duration_s=d.throughput_s, connections=d.connections
    )
    return {
        "rps": round(res.rps, 1),
        "requests": res.requests,
        "errors": res.errors,
        "cpu_us_per_req": round(cpu_s / res.requests * 1e6, 2) if res.requests else None,
    }


def sse_relay(run: Running, d: Durations, chunks: int) -> dict[str, Any]:
    """Streams of `chunks` events (one upstream write each); CPU per relayed event."""
    problem = check(run, chunks=chunks)
    body = small_chat_body(stream=True)
    if d.warmup_s > 0:
        run_wrk(run.url, body, duration_s=d.warmup_s, connections=d.sse_connections)
    res, cpu_s = measured_wrk(run, body, duration_s=d.sse_s, connections=d.sse_connections)
    relayed = res.requests * chunks
    return {
        "streams_per_s": round(res.rps, 1),
        "chunks_per_s": round(res.rps * chunks, 1),
        "chunks": relayed,
        "errors": res.errors,
        "cpu_s": round(cpu_s, 3),
        "cpu_us_per_chunk": round(cpu_s / relayed * 1e6, 3) if relayed else None,
        "p50_us_stream": res.p50_us,
        "wrk_errors": {k: v for k, v in res.as_dict().items() if k.startswith("err_") and v},
        "problem": problem,
    }


# --- long prompts end to end ------------------------------------------------------------

LONG_SIZES = {"4KB": 4 * 1024, "400KB": 400 * 1024, "4MB": 4 * 1024 * 1024}


def long_prompts(run: Running, reps: int) -> dict[str, Any]:
    """Wall time of one long request at a time, through the target, per prompt size.

    For kvproxy the admission decision's own duration comes from its metrics (by method);
    the end-to-end figure adds the upload and the forward, which the other targets pay too."""
    out: dict[str, Any] = {}
    for label, size in LONG_SIZES.items():
        body = long_chat_body(size)
        before = scrape.scrape(run.admin_url) if run.admin_url else None
        times: list[float] = []
        statuses: list[int] = []
        decided: dict[str, str] = {}
        codes: set[str] = set()
        # Warm-up (the first big read grows buffers) and a check that the target, not
        # something else on its port, relayed the upstream's reply.
        first = _problem(*post(run.url, body), None)
        if first is not None and run.admin_url is None:
            raise WrongAnswer(f"{run.name}: {first} for a {label} prompt")
        c0 = procstat.tree_cpu_s(run.pids)
        for _ in range(reps):
            t0 = time.perf_counter()
            status, headers, data = post(run.url, body)
            times.append(time.perf_counter() - t0)
            statuses.append(status)
            if status != 200:
                codes.add(_error_code(data))
            for h in ("x-kvproxy-decision", "x-kvproxy-prompt-tokens"):
                if h in headers:
                    decided[h] = headers[h]
        cpu_s = procstat.tree_cpu_s(run.pids) - c0
        row: dict[str, Any] = {
            "bytes": len(body),
            "cpu_ms_per_request": round(cpu_s / reps * 1e3, 2),
            "e2e_ms_median": round(statistics.median(times) * 1e3, 2),
            "e2e_ms_max": round(max(times) * 1e3, 2),
            "statuses": sorted(set(statuses)),
            "error_codes": sorted(codes),
            **decided,
        }
        if before is not None and run.admin_url:
            row["decision_ms_by_method"] = decision_ms(before, scrape.scrape(run.admin_url))
        out[label] = row
    return out


def decision_ms(before: scrape.Samples, after: scrape.Samples) -> dict[str, float]:
    """Mean admission-decision time per counting method, from the proxy's own histogram."""
    out: dict[str, float] = {}
    for method in scrape.label_values(after, "kvproxy_admission_duration_seconds_count", "method"):
        h = scrape.hist_delta(before, after, "kvproxy_admission_duration_seconds", method=method)
        if h.count:
            out[method] = round(h.mean * 1e3, 3)
    return out


# --- mixed: small requests while 4 MB prompts are counted -------------------------------


class BigSender(threading.Thread):
    """Sends 4 MB prompts back to back (one at a time) until stopped; keeps statuses and
    wall times, never the text."""

    def __init__(self, url: str, body: bytes, max_requests: int = 1000) -> None:
        super().__init__(name="big-sender", daemon=True)
        self.url, self.body, self.max_requests = url, body, max_requests
        self.stop_flag = threading.Event()
        self.times: list[float] = []
        self.statuses: list[int] = []
        self.codes: set[str] = set()

    def run(self) -> None:
        for _ in range(self.max_requests):
            if self.stop_flag.is_set():
                return
            t0 = time.perf_counter()
            status, _, data = post(self.url, self.body, tenant="globex")
            self.times.append(time.perf_counter() - t0)
            self.statuses.append(status)
            if status != 200:
                self.codes.add(_error_code(data))


PACED_CONNECTIONS = 2


def _paced(
    run: Running, d: Durations, delay_ms: int
) -> tuple[WrkResult, scrape.HistDelta, dict[str, float]]:
    body = small_chat_body()
    before = scrape.scrape(run.admin_url or "")
    res = run_wrk(
        run.url, body, duration_s=d.mixed_s, connections=PACED_CONNECTIONS, delay_ms=delay_ms
    )
    after = scrape.scrape(run.admin_url or "")
    lag = scrape.hist_delta(before, after, "kvproxy_event_loop_lag_seconds")
    return res, lag, decision_ms(before, after)


def mixed(run: Running, d: Durations, rate_rps: float) -> dict[str, Any]:
    """Small requests at `rate_rps` (paced, well below saturation, so their p99 shows stalls
    rather than queueing), first alone, then while 4 MB prompts are sent one after another."""
    if not run.admin_url:
        raise ValueError("mixed needs a target with kvproxy's admin port")
    check(run)
    delay_ms = max(1, round(PACED_CONNECTIONS * 1000 / rate_rps))
    idle, idle_lag, _ = _paced(run, d, delay_ms)
    sender = BigSender(run.url, long_chat_body(LONG_SIZES["4MB"]))
    sender.start()
    try:
        loaded, lag, methods = _paced(run, d, delay_ms)
    finally:
        sender.stop_flag.set()
        sender.join(120)
    max_lag = scrape.value(scrape.scrape(run.admin_url), "kvproxy_event_loop_lag_max_seconds")
    return {
        "small_rate_asked_rps": round(rate_rps, 1),
        "small_rps": round(loaded.rps, 1),
        "small_p50_us_idle": idle.p50_us,
        "small_p99_us_idle": idle.p99_us,
        "small_p50_us_loaded": loaded.p50_us,
        "small_p99_us_loaded": loaded.p99_us,
        "small_p99_ratio": round(loaded.p99_us / idle.p99_us, 2) if idle.p99_us else None,
        "small_errors": idle.errors + loaded.errors,
        "loop_lag_p99_ms_idle": round(idle_lag.quantile(0.99) * 1e3, 2),
        "loop_lag_p99_ms_loaded": round(lag.quantile(0.99) * 1e3, 2),
        "loop_lag_p99_ms_loaded_ceiling": round(lag.at_most(0.99) * 1e3, 2),
        "loop_lag_max_ms_since_start": round(max_lag * 1e3, 2),
        "big_prompts": len(sender.times),
        "big_statuses": sorted(set(sender.statuses)),
        "big_error_codes": sorted(sender.codes),
        "big_e2e_ms_median": round(statistics.median(sender.times) * 1e3, 1)
        if sender.times
        else None,
        "decision_ms_by_method": methods,
    }


def _error_code(data: bytes) -> str:
    """The `error.code` of an OpenAI-style error body (a reason, never content)."""
    try:
        err = json.loads(data).get("error", {})
    except (ValueError, AttributeError):
        return "unparsable"
    return str(err.get("code", "unknown")) if isinstance(err, dict) else "unknown"


# --- memory -----------------------------------------------------------------------------


def rss_after_warmup(run: Running, requests: int = 20) -> procstat.Memory:
    for _ in range(requests):
        post(run.url, small_chat_body())
    return procstat.memory(run.pids[0])


def peak_under_big(run: Running, concurrent: int = 16) -> dict[str, Any]:
    """VmHWM after `concurrent` 4 MB prompts sent at once: what the body-memory budget
    (`max_body_memory_bytes`) bounds, by queueing the bodies it has no room for."""
    body = long_chat_body(LONG_SIZES["4MB"])
    statuses: list[int] = []
    codes: list[str] = []

    def one() -> None:
        status, _, data = post(run.url, body, tenant="globex", timeout_s=120)
        statuses.append(status)
        if status != 200:
            codes.append(_error_code(data))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    mem = procstat.memory(run.pids[0])
    return {
        "peak_mib": round(mem.hwm_mib, 1),
        "rss_after_mib": round(mem.rss_mib, 1),
        "statuses": sorted(set(statuses)),
        "error_codes": sorted(set(codes)),
        "concurrent": concurrent,
    }
