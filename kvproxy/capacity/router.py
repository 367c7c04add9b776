"""What sits between kvproxy and the engines: detection of the upstream for `router_kind: auto`.

The router decides which request features kvproxy's exact count is verified for
(`kvproxy.tokens.gate.verified`): smg re-serialises JSON numbers as 64-bit floats and refuses
capitalised roles, an engine served directly does neither. `detect_router` asks the
upstream four read-only questions and `classify` (pure) reads the answers:

  GET /workers          smg and sglang-router answer a JSON `{"workers": [...]}` (their
                        worker registry); engines have no such route
  GET /server_info      smg answers 404 with an `x-smg-error-code` header (its error layer,
                        measured on smg 1.13.0); an SGLang engine answers its server args
                        with `version`; a PD router of the older kind (and kvproxy's
                        simulator router) answers its first prefill engine's, whose
                        `disaggregation_mode` is prefill
  GET /get_server_info  sglang-router 0.3.x answers `{"router_manager": true, ...}`
  GET /version          a vLLM engine answers `{"version": ...}`

Conclusions, first match wins:
  1. any answer carries `x-smg-error-code`                      -> smg
  2. /get_server_info has `router_manager`                       -> sglang-router
  3. /workers lists workers (a router not identified further:
     vllm-router answers /workers too)                           -> not detected
  4. /server_info is a prefill/decode engine's                   -> sglang-router (a PD
                                                                    router of the older
                                                                    kind, in front of it)
  5. /server_info is a unified SGLang engine's (has `version`)   -> none
  6. /version answers a version string                           -> none (vLLM)
  otherwise                                                      -> not detected

The monitor asks only when the answer matters: when the engines' kinds and versions read
rows of the verified table that differ by router (not for a static pool, nor for versions
no row names). "Not detected" fails towards unverified: the verified table is read for
an unknown router, which keeps only what holds behind every router (`tokens.gate.verified`);
detection is tried again at the next capacity refresh. An upstream that requires an API
key for /workers answers 401 there and is classified by the other answers.

Must never: send anything but these GETs, follow redirects, or read more than
`MAX_ANSWER_BYTES` of an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvproxy.policy import UpstreamFailure
from kvproxy.tokens import RouterKind
from kvproxy.upstream import network_boundary

PATHS = ("/workers", "/server_info", "/get_server_info", "/version")
# /server_info is ~40-160 KB on a real engine; only a few top-level fields are read.
MAX_ANSWER_BYTES = 1024 * 1024
SMG_HEADER = "x-smg-error-code"


@dataclass(frozen=True, slots=True)
class Answer:
    """One GET's outcome: status 0 when nothing came back (refused, timed out)."""

    status: int
    headers: Mapping[str, str]
    json: Any = None


Detection = tuple[RouterKind | None, str]


def classify(answers: Mapping[str, Answer]) -> Detection:
    """The router kind (None: not detected) and the evidence, from `detect_router`'s answers
    (keyed by path; a missing path counts as no answer)."""
    none = Answer(0, {})
    for path in PATHS:
        if SMG_HEADER in answers.get(path, none).headers:
            return "smg", f"GET {path} carries {SMG_HEADER} (smg's error layer)"
    legacy = _object(answers.get("/get_server_info", none))
    if legacy is not None and "router_manager" in legacy:
        return "sglang-router", "GET /get_server_info reports router_manager (sglang-router)"
    workers = _object(answers.get("/workers", none))
    if workers is not None and isinstance(workers.get("workers"), list):
        return None, "GET /workers lists workers, but the router is not one kvproxy identifies"
    info = _object(answers.get("/server_info", none)) or _object(
        answers.get("/get_server_info", none)
    )
    if info is not None:
        mode = info.get("disaggregation_mode")
        if mode in ("prefill", "decode"):
            return "sglang-router", (
                f"GET /server_info answers a {mode} engine's: a PD router forwarding its first "
                "prefill engine's (sglang-router's older behaviour)"
            )
        if isinstance(info.get("version"), str) and mode in (None, "null"):
            return "none", "GET /server_info answers an SGLang engine's own server arguments"
    version = _object(answers.get("/version", none))
    if version is not None and isinstance(version.get("version"), str):
        return "none", "GET /version answers an engine's version (vLLM)"
    seen = ", ".join(f"{p} {answers[p].status or 'no answer'}" for p in PATHS if p in answers)
    return None, f"no router or engine recognised ({seen or 'no answers'})"


def _object(answer: Answer) -> dict[str, Any] | None:
    if answer.status == 200 and isinstance(answer.json, dict):
        return answer.json
    return None


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Answer:
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)
    try:
        with network_boundary():
            async with session.get(url, timeout=timeout, allow_redirects=False) as resp:
                headers = {k.lower(): v for k, v in resp.headers.items()}
                body = await resp.content.read(MAX_ANSWER_BYTES + 1)
    except (UpstreamFailure, aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return Answer(0, {})
    data: Any = None
    if len(body) <= MAX_ANSWER_BYTES:
        with contextlib.suppress(orjson.JSONDecodeError):
            data = orjson.loads(body)
    return Answer(resp.status, headers, data)


async def detect_router(
    session: aiohttp.ClientSession, upstream: str, timeout_s: float
) -> Detection:
    """Ask the upstream the four questions at once (each bounded by `timeout_s`)."""
    base = upstream.rstrip("/")
    got = await asyncio.gather(*(_get(session, base + p, timeout_s) for p in PATHS))
    return classify(dict(zip(PATHS, got, strict=True)))


__all__ = ["PATHS", "Answer", "Detection", "classify", "detect_router"]
