"""Reading engine reports: fetching JSON and Prometheus text, and typed field reads.

Owns the only translation of transport failures into `ProbeError` reasons (built on
`kvproxy.upstream.boundary.network_boundary`, so the proxy and the probes agree on what a
timeout or a reset is), the response size cap, the extraction of only the Prometheus
series a probe asks for, and the strictness every probe shares: a
token count is a JSON integer >= 1 (not a bool, float or string), `null` means "not
reported", and when several fields report one number the smallest wins.

Must never: guess. An HTML page, a truncated body or a value that does not parse is a
`ProbeError` with a reason, not a default; a wrong type is never coerced into a number.
Bodies are described, never quoted at length.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from kvproxy.capacity.measurement import ProbeError
from kvproxy.policy import NetworkKind, UpstreamFailure
from kvproxy.upstream import failure_from, network_boundary

# /server_info is ~40-160 KB; vLLM /metrics with histograms a few hundred KB. 16 MiB is
# far above any honest answer and still bounds memory against a misbehaving endpoint.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024

# The seam's kind -> the ProbeError reason the capacity metrics and /capacity show.
_KIND_TO_REASON: dict[NetworkKind, str] = {
    "timeout": "timeout",
    "dns": "dns",
    "connect": "connect",
    "reset": "protocol",
    "protocol": "protocol",
}


class HttpStatusError(ProbeError):
    """A non-2xx answer; `status` lets a probe fall back to an older endpoint name."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__("http_status", f"GET {url} answered HTTP {status}")
        self.status = status


def probe_error_from_exception(exc: BaseException, url: str) -> ProbeError:
    """Map a transport exception to a ProbeError; re-raises what is not transport."""
    if isinstance(exc, ProbeError):
        return exc
    failure = exc if isinstance(exc, UpstreamFailure) else failure_from(exc)
    if failure.kind == "dns":
        return ProbeError("dns", f"GET {url}: host name did not resolve")
    cause = failure.cause or type(exc).__name__
    return ProbeError(_KIND_TO_REASON[failure.kind], f"GET {url}: {cause}")


def _describe(content_type: str, body: bytes) -> str:
    return f"{content_type or 'no content type'}, {len(body):,} bytes"


async def fetch(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[str, bytes]:
    """GET `url`; return (content type, body) of a 2xx answer or raise ProbeError."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)
    try:
        with network_boundary():
            async with session.get(url, timeout=timeout, allow_redirects=False) as resp:
                if not 200 <= resp.status < 300:
                    # Drain nothing: the connection is closed with the context manager.
                    raise HttpStatusError(resp.status, url)
                declared = resp.content_length
                if declared is not None and declared > MAX_RESPONSE_BYTES:
                    raise ProbeError("too_large", f"GET {url}: {declared:,} bytes declared")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    size += len(chunk)
                    if size > MAX_RESPONSE_BYTES:
                        raise ProbeError(
                            "too_large", f"GET {url}: over {MAX_RESPONSE_BYTES:,} bytes"
                        )
                    chunks.append(chunk)
                return resp.content_type, b"".join(chunks)
    except UpstreamFailure as failure:
        raise probe_error_from_exception(failure, url) from None


async def fetch_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any]:
    """GET a JSON object; HTML pages, malformed JSON and non-objects are ProbeErrors."""
    content_type, body = await fetch(session, url, timeout_s)
    if "html" in content_type or body.lstrip()[:1] == b"<":
        raise ProbeError("not_json", f"GET {url}: HTML page ({_describe(content_type, body)})")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ProbeError(
            "not_json", f"GET {url}: malformed JSON ({_describe(content_type, body)})"
        ) from None
    if not isinstance(data, dict):
        raise ProbeError(
            "bad_type", f"GET {url}: expected a JSON object, got {type(data).__name__}"
        )
    return data


async def fetch_text(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    """GET Prometheus exposition text."""
    content_type, body = await fetch(session, url, timeout_s)
    if "html" in content_type or body.lstrip()[:1] == b"<":
        raise ProbeError("not_metrics", f"GET {url}: HTML page ({_describe(content_type, body)})")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ProbeError(
            "not_metrics", f"GET {url}: not UTF-8 text ({_describe(content_type, body)})"
        ) from None


# --- Prometheus text --------------------------------------------------------------------

Sample = tuple[dict[str, str], float]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def parse_prometheus(text: str, names: Collection[str]) -> dict[str, list[Sample]]:
    """Samples of the metric names asked for. A malformed line of one of them is an error;
    other lines are skipped unread (the exposition is large and we need a handful)."""
    found: dict[str, list[Sample]] = {name: [] for name in names}
    for raw in text.splitlines():
        line = raw.strip()
        m = _NAME.match(line)
        if m is None or m.group(0) not in found:
            continue
        # prometheus_client's parser on the selected lines only: 13 ms on a 731 KB,
        # 7,947-line exposition, against 380 ms for the whole text.
        name = m.group(0)
        try:
            (sample,) = (s for f in text_string_to_metric_families(line) for s in f.samples)
        except ValueError:
            sample = None
        if sample is None or sample.name != name:  # `m,{} 1` is no sample of m
            raise ProbeError("not_metrics", f"malformed sample of {name}")
        found[name].append((dict(sample.labels), float(sample.value)))
    return found


def looks_like_prometheus(text: str) -> bool:
    """True when at least one line is a comment or a `name value` sample."""
    for raw in text.splitlines()[:200]:
        line = raw.strip()
        if not line:
            continue
        if line.startswith("# ") or line.startswith("#"):
            return True
        m = _NAME.match(line)
        if m is not None and m.end() < len(line) and line[m.end()] in "{ \t":
            return True
    return False


# --- typed fields ----------------------------------------------------------------------


def token_field(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    """`obj[key]` as a positive int; None when absent or null; ProbeError otherwise."""
    if key not in obj or obj[key] is None:
        return None
    value = obj[key]
    # bool is an int subclass in Python; `true` is never a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProbeError("bad_type", f"{where} is {type(value).__name__}, expected an integer")
    if value < 1:
        raise ProbeError("bad_value", f"{where} = {value} is not a positive token count")
    return value


def label_token_count(labels: Mapping[str, str], key: str, where: str) -> int | None:
    """A Prometheus label holding a token/block count; "None"/"" mean not reported."""
    raw = labels.get(key)
    if raw is None or raw in ("", "None", "none", "null"):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ProbeError("bad_type", f"{where} = {raw[:32]!r} is not an integer") from None
    if value < 1:
        raise ProbeError("bad_value", f"{where} = {value} is not a positive count")
    return value


def object_list(obj: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    """`obj[key]` as a list of objects; [] when absent or null."""
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProbeError("bad_type", f"{where} is {type(value).__name__}, expected a list")
    items: list[Mapping[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ProbeError(
                "bad_type", f"{where}[{i}] is {type(item).__name__}, expected an object"
            )
        items.append(item)
    return items


@dataclass
class Reports:
    """Several reports of one number: (value, source field), smallest wins."""

    what: str
    items: list[tuple[int, str]] = field(default_factory=list)

    def add(self, value: int | None, source: str) -> None:
        if value is not None:
            self.items.append((value, source))

    def __bool__(self) -> bool:
        return bool(self.items)

    def smallest(self) -> tuple[int, str]:
        # Ties keep the first-added source: callers add the most specific field first.
        best = self.items[0]
        for item in self.items[1:]:
            if item[0] < best[0]:
                best = item
        return best

    def disagreement(self) -> str | None:
        values = {v for v, _ in self.items}
        if len(values) <= 1:
            return None
        shown = ", ".join(f"{src}={v:,}" for v, src in self.items)
        return f"{self.what} reports differ ({shown}); using the smallest"


def distinct(values: Sequence[int]) -> bool:
    return len(set(values)) > 1
