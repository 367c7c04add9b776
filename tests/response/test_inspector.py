"""The response inspector without sockets (kvproxy/response/inspector.py): bytes in; what may be
forwarded, output seen, hits, withhold/refuse and `usage` out. The relay through a real
app is tests/serve/test_relay.py."""

from __future__ import annotations

import orjson
import pytest

from kvproxy.config import CanaryTenant
from kvproxy.response import inspector, sse
from kvproxy.response.inspector import ResponseInspector, Step
from kvproxy.response.tripwire import CanaryRules, CanaryScanner

MARKER = "KVCANARY-acme-0123456789abcdef"


def scanner(tenant: str = "bob") -> CanaryScanner:
    rules = CanaryRules.from_tenants(
        [CanaryTenant(tenant="acme", patterns=("KVCANARY-acme-[0-9a-f]{16}",))]
    )
    return rules.scanner(tenant)


def event(content: str, usage: int | None = None) -> bytes:
    obj: dict[str, object] = {"choices": [{"index": 0, "delta": {"content": content}}]}
    if usage is not None:
        obj["usage"] = {"prompt_tokens": usage, "completion_tokens": 1}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def pump(insp: ResponseInspector, chunks: list[bytes]) -> tuple[bytes, list[Step]]:
    """What the relay does with a present client: feed, keep, forward; then finish."""
    out = bytearray()
    steps = []
    for chunk in chunks:
        step = insp.feed(chunk)
        steps.append(step)
        if step.withhold:
            return bytes(out), steps
        kept = insp.keep(step.forward)
        steps.append(kept)
        if kept.refuse is not None:
            return bytes(out), steps
        out += kept.forward
    end = insp.finish()
    steps.append(end)
    out += end.forward
    return bytes(out), steps


def test_a_clean_stream_is_forwarded_whole_events_only_with_output_and_usage() -> None:
    stream = event("Hel") + event("lo") + event("", usage=42) + b"data: [DONE]\n\n"
    insp = ResponseInspector(scanner(), sse=True, block=True, read_usage=False)
    cut = [stream[:10], stream[10:57], stream[57:]]
    first = insp.feed(cut[0])
    assert first.forward == b""  # half an event: held until it ends (it could hold a marker)
    assert not first.output
    out, steps = pump(insp, cut[1:])
    assert first.forward + out == stream
    assert any(s.output for s in steps)
    assert not any(s.hits for s in steps)
    assert insp.prompt_tokens == 42


def test_a_marker_split_across_chunks_is_withheld_before_any_of_it_is_forwarded() -> None:
    stream = event("fine ") + event(MARKER[:9]) + event(MARKER[9:]) + event(" tail")
    for at in range(1, len(stream)):
        insp = ResponseInspector(scanner(), sse=True, block=True, read_usage=False)
        out, steps = pump(insp, [stream[:at], stream[at:]])
        assert steps[-1].withhold, at
        assert [h.owner_tenant for s in steps for h in s.hits] == ["acme"]
        assert MARKER[9:].encode() not in out


def test_observe_mode_reports_the_hit_and_forwards_everything() -> None:
    stream = event(MARKER) + event("more")
    insp = ResponseInspector(scanner(), sse=True, block=False, read_usage=False)
    out, steps = pump(insp, [stream])
    assert out == stream
    assert sum(len(s.hits) for s in steps) == 1
    assert not any(s.withhold for s in steps)


def test_the_owner_of_a_marker_is_not_withheld_its_own() -> None:
    insp = ResponseInspector(scanner("acme"), sse=True, block=True, read_usage=False)
    out, steps = pump(insp, [event(MARKER)])
    assert out == event(MARKER)
    assert not any(s.hits for s in steps)


def test_a_stream_that_ends_inside_an_event_is_scanned_as_a_body() -> None:
    tail = b'data: {"choices": [{"delta": {"content": "' + MARKER.encode()
    insp = ResponseInspector(scanner(), sse=True, block=True, read_usage=False)
    _, steps = pump(insp, [event("a"), tail])
    assert steps[-1].withhold
    assert steps[-1].forward == tail  # what the relay must not send


def test_block_mode_holds_a_body_until_its_end_and_scans_it_whole() -> None:
    body = orjson.dumps({"choices": [{"text": "x" * 100 + MARKER}], "usage": {"prompt_tokens": 7}})
    insp = ResponseInspector(scanner(), sse=False, block=True, read_usage=True)
    assert insp.hold
    out, steps = pump(insp, [body[:50], body[50:120], body[120:]])
    assert out == body  # the relay sends end.forward only when not withheld
    end = steps[-1]
    assert end.withhold
    kept = steps[1:-1:2]  # pump appends feed's step, then keep's
    assert len(kept) == 3
    assert all(s.forward == b"" for s in kept)  # held: nothing forwarded before the end
    assert insp.prompt_tokens == 7

    clean = orjson.dumps({"choices": [{"text": "fine"}]})
    insp = ResponseInspector(scanner(), sse=False, block=True, read_usage=True)
    out, steps = pump(insp, [clean[:5], clean[5:]])
    assert out == clean
    assert not steps[-1].withhold


def test_a_held_body_past_the_scan_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspector, "SCAN_BODY_BYTES", 1000)
    insp = ResponseInspector(scanner(), sse=False, block=True, read_usage=True)
    _, steps = pump(insp, [b"x" * 600, b"x" * 600])
    assert steps[-1].refuse is not None
    assert steps[-1].refuse.code == "upstream_bad_response"
    assert "too large to scan" in steps[-1].refuse.message


def test_observe_mode_relays_as_it_reads_and_reports_once_past_the_scan_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(inspector, "SCAN_BODY_BYTES", 1000)
    insp = ResponseInspector(scanner(), sse=False, block=False, read_usage=False)
    assert not insp.hold
    seen = []
    for _ in range(4):
        step = insp.keep(b"y" * 400)
        assert step.forward == b"y" * 400  # relayed as it came
        seen.append(insp.truncated)
    assert seen == [False, False, True, True]  # became true once: one warning
    assert len(insp.kept) == 1200  # stopped keeping once past the bound


def test_without_a_tripwire_only_usage_is_read_and_nothing_is_held() -> None:
    body = orjson.dumps({"usage": {"prompt_tokens": 3}, "choices": [{"text": MARKER}]})
    insp = ResponseInspector(None, sse=False, block=True, read_usage=True)
    assert not insp.hold
    out, steps = pump(insp, [body])
    assert out == body
    assert not any(s.hits or s.withhold for s in steps)
    assert insp.prompt_tokens == 3
    assert insp.keep_limit == inspector.KEEP_BODY_BYTES


def test_an_oversized_event_raises_for_the_relay_to_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "DEFAULT_MAX_EVENT_BYTES", 64)
    insp = ResponseInspector(scanner(), sse=True, block=True, read_usage=False)
    with pytest.raises(sse.SSEError):
        insp.feed(b"data: " + b"z" * 200)
