"""preStop hook of the router container: keep the router up until kvproxy has drained.

Why this exists: kvproxy runs as a native sidecar, so when the Pod terminates Kubernetes
signals the router first and kvproxy only after the router has exited. Every request
kvproxy still holds (a live stream, or a deferred cancellation waiting for the KV transfer
to finish) goes through this router; stopping the router under it would close the engine
connections early, which is the very race kvproxy defers.

What it does, in order:
1. sleeps ``--endpoint-delay-s`` so EndpointSlices, kube-proxy and ingress controllers stop
   sending new requests to this Pod;
2. polls kvproxy's admin ``/metrics`` and returns once ``kvproxy_inflight_requests`` (which
   counts deferred cancellations too) has read 0 on ``--quiet-polls`` polls in a row, or
   the admin port has been unreachable ``--unreachable-polls`` times in a row (kvproxy is
   gone: nothing left to protect), or ``--max-wait-s`` has passed since the hook started.

It always exits 0: a failing preStop hook only produces an event, and Kubernetes stops the
container either way. It reads metric values only, never request content. It runs inside
the router image, so it uses the standard library only and runs on Python 3.9 or newer.
"""

from __future__ import annotations

import argparse
import http.client
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence

INFLIGHT_METRIC = "kvproxy_inflight_requests"
_SAMPLE = re.compile(r"^" + INFLIGHT_METRIC + r"(?:\{[^}]*\})?[ \t]+(?P<value>[-+0-9.eEinfaINFA]+)")

Fetch = Callable[[str, float], str]


def parse_inflight(exposition: str) -> float | None:
    """Sum of every ``kvproxy_inflight_requests`` sample, or None when the metric is absent."""
    total: float | None = None
    for line in exposition.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        total = (total or 0.0) + float(match.group("value"))
    return total


def http_fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body: bytes = response.read()
    return body.decode("utf-8", errors="replace")


def wait_for_drain(
    metrics_url: str,
    *,
    endpoint_delay_s: float,
    max_wait_s: float,
    poll_interval_s: float = 1.0,
    quiet_polls: int = 2,
    unreachable_polls: int = 3,
    fetch: Fetch = http_fetch,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> str:
    """Block until kvproxy is idle, gone, or out of time; return why (for the log and tests)."""
    deadline = clock() + max_wait_s
    sleep(min(endpoint_delay_s, max_wait_s))
    zeros = 0
    misses = 0
    while clock() < deadline:
        try:
            inflight = parse_inflight(fetch(metrics_url, max(poll_interval_s, 1.0)))
        except (OSError, http.client.HTTPException, ValueError):
            inflight = None
            misses += 1
        else:
            misses = 0
        if misses >= unreachable_polls:
            log("kvproxy admin port unreachable; not waiting any longer")
            return "unreachable"
        if inflight is not None:
            zeros = zeros + 1 if inflight <= 0 else 0
            if zeros >= quiet_polls:
                log("kvproxy has nothing in flight; letting the router stop")
                return "drained"
        sleep(max(0.0, min(poll_interval_s, deadline - clock())))
    log(f"kvproxy still busy after {max_wait_s:g} s; letting the router stop")
    return "timeout"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-url", default="http://127.0.0.1:9090/metrics")
    parser.add_argument("--endpoint-delay-s", type=float, default=10.0)
    parser.add_argument("--max-wait-s", type=float, required=True)
    parser.add_argument("--poll-interval-s", type=float, default=1.0)
    parser.add_argument("--quiet-polls", type=int, default=2)
    parser.add_argument("--unreachable-polls", type=int, default=3)
    args = parser.parse_args(list(argv) if argv is not None else None)
    wait_for_drain(
        args.metrics_url,
        endpoint_delay_s=args.endpoint_delay_s,
        max_wait_s=args.max_wait_s,
        poll_interval_s=args.poll_interval_s,
        quiet_polls=args.quiet_polls,
        unreachable_polls=args.unreachable_polls,
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a hook must never fail the termination
        print(f"wait_for_kvproxy_drain: {exc!r}", file=sys.stderr)
        sys.exit(0)
