"""The router's preStop hook (deploy/base/hooks/wait_for_kvproxy_drain.py).

Policy is tested with a scripted fetch and a fake clock (no waiting); one test runs the
script for real against a local /metrics server, with the exposition that kvproxy's own
Metrics registry produces.
"""

from __future__ import annotations

import http.server
import importlib.util
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import generate_latest

from kvproxy.observe.metrics import Metrics

HOOK = Path(__file__).resolve().parents[2] / "deploy/base/hooks/wait_for_kvproxy_drain.py"


def load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wait_for_kvproxy_drain", HOOK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load_hook()


def exposition(inflight: float) -> str:
    metrics = Metrics()
    metrics.inflight.set(inflight)
    return generate_latest(metrics.registry).decode()


class FakeTime:
    """A clock that only moves when the hook sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def scripted(replies: list[str | Exception]) -> tuple[Callable[[str, float], str], list[str]]:
    calls: list[str] = []

    def fetch(url: str, timeout_s: float) -> str:
        calls.append(url)
        reply = replies[min(len(calls), len(replies)) - 1]
        if isinstance(reply, Exception):
            raise reply
        return reply

    return fetch, calls


def run(fetch: Callable[[str, float], str], t: FakeTime, **kwargs: float) -> str:
    options: dict[str, float] = {"endpoint_delay_s": 10, "max_wait_s": 330, **kwargs}
    result: str = hook.wait_for_drain(
        "http://127.0.0.1:9090/metrics",
        fetch=fetch,
        sleep=t.sleep,
        clock=t.clock,
        log=lambda msg: None,
        **options,
    )
    return result


def test_reads_the_gauge_kvproxy_exports() -> None:
    # The metric name is a contract with kvproxy/observe/metrics.py, checked on its real output.
    assert hook.INFLIGHT_METRIC == "kvproxy_inflight_requests"
    assert hook.parse_inflight(exposition(3)) == 3
    assert hook.parse_inflight(exposition(0)) == 0


def test_parse_sums_labelled_series_and_ignores_lookalikes() -> None:
    text = (
        "# HELP kvproxy_inflight_requests x\n"
        "# TYPE kvproxy_inflight_requests gauge\n"
        'kvproxy_inflight_requests{worker="a"} 2.0\n'
        'kvproxy_inflight_requests{worker="b"} 1\n'
        "kvproxy_inflight_requests_max 99\n"
        "kvproxy_inflight_prompt_tokens 12345\n"
    )
    assert hook.parse_inflight(text) == 3
    assert hook.parse_inflight("kvproxy_requests_total 5\n") is None


def test_waits_for_the_endpoint_delay_then_for_two_quiet_polls() -> None:
    busy, idle = exposition(2), exposition(0)
    fetch, calls = scripted([busy, busy, idle, busy, idle, idle, busy])
    t = FakeTime()
    assert run(fetch, t) == "drained"
    # One zero between busy reads is not enough: a keep-alive client may still be sending.
    assert len(calls) == 6
    assert t.sleeps[0] == 10


def test_gives_up_when_kvproxy_is_gone() -> None:
    fetch, calls = scripted([exposition(1), ConnectionRefusedError(), OSError(), OSError()])
    assert run(fetch, FakeTime()) == "unreachable"
    assert len(calls) == 4


def test_one_failed_scrape_does_not_end_the_wait() -> None:
    idle = exposition(0)
    fetch, calls = scripted([exposition(1), OSError(), idle, idle])
    assert run(fetch, FakeTime()) == "drained"
    assert len(calls) == 4


def test_never_waits_past_max_wait() -> None:
    fetch, calls = scripted([exposition(5)])
    t = FakeTime()
    assert run(fetch, t, max_wait_s=30, poll_interval_s=1) == "timeout"
    assert t.now - 1000.0 == pytest.approx(30)
    # 10 s endpoint delay, then one poll a second for the remaining 20 s.
    assert len(calls) == 20


def test_endpoint_delay_is_capped_by_max_wait() -> None:
    fetch, calls = scripted([exposition(5)])
    t = FakeTime()
    assert run(fetch, t, endpoint_delay_s=60, max_wait_s=5) == "timeout"
    assert t.now - 1000.0 == pytest.approx(5)
    assert calls == []


class _Metrics(http.server.BaseHTTPRequestHandler):
    """Serves an in-flight count that drops by one on every scrape until it reaches 0."""

    remaining = 3
    served = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            type(self).served += 1
            value = type(self).remaining
            type(self).remaining = max(0, value - 1)
        body = exposition(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_script_runs_as_the_hook_command(metrics_server: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(HOOK),
            f"--metrics-url={metrics_server}",
            "--endpoint-delay-s=0",
            "--max-wait-s=60",
            "--poll-interval-s=0.01",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert "nothing in flight" in proc.stderr
    # 3, 2, 1 in flight, then two quiet scrapes.
    assert _Metrics.served == 5


def test_script_exits_zero_even_when_nothing_answers() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(HOOK),
            "--metrics-url=http://127.0.0.1:9/metrics",
            "--endpoint-delay-s=0",
            "--max-wait-s=30",
            "--poll-interval-s=0.01",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert "unreachable" in proc.stderr
