"""The smg replica (`smg.forward`) held against the real smg 1.13.0 binary: smg in PD mode in
front of two capture workers on loopback, every corpus body and a seeded draw of fuzzed
bodies sent through it; what the prefill worker receives must be what the replica says
(the same refusals, the same values in the same key order, numbers printed the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from real_router import smg_router

from oracles import smg
from oracles.capture import capture_pair
from oracles.common import Refused, Unmodelled
from oracles.corpus import CASES
from oracles.fuzz import CLASSES
from oracles.kvproxy_side import ROUTES

pytestmark = [pytest.mark.slow, pytest.mark.router]

FUZZED_PER_CLASS = 25
# Fields smg's typed request adds or the PD router injects, beyond what the client sent.
ADDED = {
    "logprobs", "stream", "echo", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    # generate.rs GenerateRequest's typed defaults
    "background", "log_metrics", "no_logs", "return_bytes", "return_entropy",
    "return_text_in_logprobs",
}  # fmt: skip
# chat_template_kwargs is a HashMap in smg: its key order is not kept.
UNORDERED = {"chat_template_kwargs"}


def _printed(v: Any, key: str = "") -> Any:
    """A JSON value with every number as the text it is printed with, dicts as ordered
    item lists (except the unordered maps)."""
    if isinstance(v, tuple):
        return v
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, float):
        return ("num", smg.ryu(v))
    if isinstance(v, int):
        return ("num", str(v))
    if isinstance(v, list):
        return [_printed(x) for x in v]
    items = [(k, _printed(x, k)) for k, x in v.items()]
    return sorted(items) if key in UNORDERED else items


def _captured(raw: bytes) -> Any:
    def num(text: str) -> tuple[str, str]:
        return ("num", text)

    return json.loads(raw, parse_int=num, parse_float=num)


def _ordered(v: Any, key: str = "") -> Any:
    if isinstance(v, list):
        return [_ordered(x) for x in v]
    if isinstance(v, dict):
        items = [(k, _ordered(x, k)) for k, x in v.items()]
        return sorted(items) if key in UNORDERED else items
    return v


def _fuzzed() -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []

    @settings(
        max_examples=FUZZED_PER_CLASS * len(CLASSES),
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        klass = data.draw(st.sampled_from(sorted(CLASSES)))
        route, _engine, body = data.draw(CLASSES[klass])
        if route in smg.FORWARD:
            out.append((route, body))

    draw()
    return out


async def test_the_smg_replica_forwards_what_smg_forwards(tmp_path: Path) -> None:
    bodies = [(c.route, c.bytes()) for c in CASES if c.route in smg.FORWARD] + _fuzzed()
    mismatches: list[str] = []
    checked = refused = 0
    async with capture_pair() as (prefill, decode):
        async with smg_router(prefill.url, decode.url, tmp_path / "smg.log") as router:
            async with aiohttp.ClientSession() as http:
                for route, body in bodies:
                    try:
                        expected: dict[str, Any] | None = smg.forward(route, body)
                    except Refused:
                        expected = None
                    except Unmodelled:
                        continue
                    before = len(prefill.bodies)
                    async with http.post(
                        router.url + ROUTES[route],
                        data=body,
                        headers={"content-type": "application/json"},
                    ) as r:
                        await r.read()
                        status = r.status
                    got = prefill.bodies[before:]
                    checked += 1
                    if expected is None:
                        refused += 1
                        if got or status < 400:
                            mismatches.append(f"replica refuses, smg {status}: {body[:200]!r}")
                        continue
                    if len(got) != 1:
                        mismatches.append(f"smg {status}, {len(got)} forwarded: {body[:200]!r}")
                        continue
                    sent = _captured(got[0][1])
                    extra = set(sent) - set(expected) - ADDED
                    # Top-level order is the typed struct's; SGLang reads fields by name.
                    want = sorted(_printed(expected))
                    have = sorted(_ordered({k: v for k, v in sent.items() if k in expected}))
                    if extra or have != want:
                        mismatches.append(
                            f"{body[:300]!r}\n  extra {sorted(extra)}\n  smg     {have}\n"
                            f"  replica {want}"
                        )
    assert checked > 100
    assert 0 < refused < checked
    assert not mismatches, f"{len(mismatches)} of {checked}:\n" + "\n".join(
        m[:3000] for m in mismatches[:5]
    )
