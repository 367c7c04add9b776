"""The HTTP client the release gate (`kvproxy check`) and the isolation harness (`kvproxy
canary`) share: one request/reply reader, the model the target serves, the engine's own
tokenizer, boundary prompts of an exact length, and the simulator's ground truth
(`ProbeClient.observe`: a request between two `/sim/stats` reads).

Owns: how a reply is read (status, error code, the text a client received, whether kvproxy's
tripwire withheld it); what counts as the target *refusing* a probe (any 4xx/5xx or transport
error that is not the expected `context_length_exceeded`), and the hint printed with it;
how a prompt of exactly N tokens is built. Lengths come from the engine's `/tokenize`
(SGLang and vLLM both have one), never from kvproxy's own counter: the probe must measure
kvproxy, not agree with it.

Every wait is bounded by a named timeout below. Never returns or logs reply text except to
the caller that scans it for markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from kvproxy.policy import ERROR_CODE_HEADER, UpstreamFailure
from kvproxy.response import SSEParser, body_texts, token_texts
from kvproxy.upstream import network_boundary

# One GET (models, server info, stats) or one /tokenize call.
PROBE_TIMEOUT_S = 10.0
# One generation request: long enough for a full prompt echo on a loaded machine.
REQUEST_TIMEOUT_S = 120.0
# Binary search over characters: log2(characters) calls per length; bounded anyway.
MAX_TOKENIZE_CALLS = 64
ProbeKind = Literal["text", "token_ids"]
ProbeChoice = Literal["auto", "text", "token_ids"]


@dataclass
class Reply:
    status: int  # 0: no HTTP answer (see `error`)
    code: str | None
    texts: list[str]
    blocked: bool  # kvproxy's tripwire withheld foreign data
    decision: str | None  # X-Kvproxy-Decision: the target is (or is behind) kvproxy
    error: str | None = None

    @property
    def context_length_exceeded(self) -> bool:
        return self.status == 400 and self.code == "context_length_exceeded"

    def refused(self) -> bool:
        """The target did not serve the probe, and not for the reason a probe expects."""
        if self.blocked or self.context_length_exceeded:
            return False
        return self.status == 0 or self.status >= 400

    def describe(self) -> str:
        if self.status == 0:
            return self.error or "no answer"
        return f"{self.status} {self.code}" if self.code else str(self.status)


class TargetRefused(Exception):
    """A probe was answered with an error that makes the scenario meaningless: stop it now
    rather than wait for arrivals that cannot come."""

    def __init__(self, what: str, reply: Reply) -> None:
        self.reply = reply
        super().__init__(f"target refused the {what}: {reply.describe()}{refusal_hint(reply)}")


def refusal_hint(reply: Reply) -> str:
    code = reply.code or ""
    if reply.status == 0:
        return " — is the target reachable?"
    if code in ("no_available_workers", "model_not_found") or reply.status == 404:
        return " — is --model right?"
    if code == "invalid_type":
        return " — the target refuses this prompt shape"
    if reply.status in (401, 403):
        return " — does it need --api-key?"
    if reply.status == 429:
        return " — the target is saturated or its budget is smaller than the probe"
    return ""


def parse_reply(status: int, headers: Any, raw: bytes) -> Reply:
    decision = headers.get("X-Kvproxy-Decision")
    ctype = headers.get("Content-Type", "")
    code: str | None = None
    texts: list[str] = []
    blocked = False
    if ctype.startswith("text/event-stream"):
        per_index: dict[int, list[str]] = {}
        for payload in SSEParser().feed(raw):
            if b'"canary_violation"' in payload:
                blocked = True
            for index, text in token_texts(payload):
                per_index.setdefault(index, []).append(text)
        texts = ["".join(parts) for parts in per_index.values()]
        return Reply(status, code, texts, blocked, decision)
    try:
        data = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            code = err.get("code") if isinstance(err.get("code"), str) else None
    # SGLang's native shape has no code field: kvproxy puts it in a header (kvproxy.serve.replies).
    code = code or headers.get(ERROR_CODE_HEADER)
    blocked = code == "canary_violation"
    texts = body_texts(raw) if status == 200 else []
    return Reply(status, code, texts, blocked, decision)


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> Reply:
    try:
        with network_boundary():
            async with http.post(
                url,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", **headers},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return parse_reply(resp.status, resp.headers, await resp.read())
    except UpstreamFailure as failure:
        # No HTTP answer: the reply names the exception type (never its message).
        return Reply(0, None, [], False, None, error=failure.cause)


async def get_json(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> Any:
    """The JSON at `url`, or None (unreachable, not 200, not JSON)."""
    try:
        with network_boundary():
            async with http.get(
                url, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
    except (UpstreamFailure, ValueError):  # ValueError: the body is not JSON
        return None


# --- the model ------------------------------------------------------------------------------


class ModelUnknown(Exception):
    pass


async def listed_models(
    http: aiohttp.ClientSession, base: str, headers: dict[str, str]
) -> list[str] | None:
    """The model ids `base`'s `/v1/models` lists, in its order; None when it does not answer
    one (no such route, not JSON, no `data` list)."""
    data = await get_json(http, base + "/v1/models", headers)
    listed = data.get("data") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        return None
    return [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def discover_model(
    http: aiohttp.ClientSession, bases: list[str], headers: dict[str, str]
) -> tuple[str, str]:
    """(model id, where it came from): the only id in the first `/v1/models` that lists any.
    Routers such as smg route by model and answer 503 for any other name, so a guessed
    default is worse than asking. Several ids: the operator must choose."""
    for base in bases:
        ids = await listed_models(http, base, headers)
        if ids is None:
            continue
        if len(ids) == 1:
            return ids[0], f"{base}/v1/models"
        if len(ids) > 1:
            raise ModelUnknown(
                f"{base}/v1/models lists {len(ids)} models ({', '.join(ids[:20])}): "
                "pass --model with the one to probe"
            )
    raise ModelUnknown(
        f"no /v1/models answered at {', '.join(bases)}: pass --model with the model id "
        "the engines serve"
    )


# --- the engine's tokenizer and exact-length prompts --------------------------------------


class EngineTokenizer:
    """The engine's own `/tokenize` (`{"prompt": str}` → `{"tokens", "count"}`), with the
    special tokens the engine adds to a completions prompt (SGLang and vLLM default
    `add_special_tokens` to true)."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http = http
        self.base = base
        self.calls = 0

    async def tokens(self, text: str) -> list[int] | None:
        self.calls += 1
        try:
            with network_boundary():
                async with self.http.post(
                    self.base + "/tokenize",
                    data=orjson.dumps({"prompt": text}),
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
                ) as resp:
                    if resp.status != 200:
                        return None
                    data = await resp.json(content_type=None)
        except (UpstreamFailure, ValueError):  # ValueError: the body is not JSON
            return None
        toks = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
            return toks
        return None


async def find_tokenizer(http: aiohttp.ClientSession, bases: list[str]) -> EngineTokenizer | None:
    for base in dict.fromkeys(bases):
        tok = EngineTokenizer(http, base)
        if await tok.tokens("kvproxy probe") is not None:
            return tok
    return None


async def exact_text(tok: EngineTokenizer, seed: str, n: int) -> str | None:
    """A prefix of `seed` repeated whose engine token count is exactly `n`, or None.

    Binary search over the character length for the shortest prefix reaching n tokens; with
    ASCII text one more character adds at most one token, so that prefix has n tokens (else
    the next few characters are tried). Bounded by MAX_TOKENIZE_CALLS."""
    text = seed
    for _ in range(40):  # doubling: at most 2^40 x the seed
        toks = await tok.tokens(text)
        if toks is None:
            return None
        if len(toks) >= n:
            break
        text = text * 2
    else:
        return None
    lo, hi = 0, len(text)
    start = tok.calls
    while lo < hi and tok.calls - start < MAX_TOKENIZE_CALLS:
        mid = (lo + hi) // 2
        count = await tok.tokens(text[:mid])
        if count is None:
            return None
        if len(count) >= n:
            hi = mid
        else:
            lo = mid + 1
    for length in range(hi, min(len(text), hi + 8) + 1):
        got = await tok.tokens(text[:length])
        if got is not None and len(got) == n:
            return text[:length]
    return None


@dataclass
class BoundaryPrompts:
    """Prompts of limit-1, limit and limit+1 tokens as the engine counts them."""

    kind: ProbeKind
    prompts: dict[int, str | list[int]]  # tokens -> the prompt
    note: str


async def boundary_prompts(
    http: aiohttp.ClientSession,
    tokenizer_bases: list[str],
    seed: str,
    counts: list[int],
    prefer: ProbeChoice = "auto",
) -> BoundaryPrompts:
    """Text prompts when the engine's tokenizer is reachable (they pass any router that takes
    ordinary prompts; smg 1.13 refuses token-id prompts with 400 invalid_type), token ids
    otherwise or when asked (exact for kvproxy and the engine alike)."""
    tok = await find_tokenizer(http, tokenizer_bases)
    if tok is not None and prefer != "token_ids":
        texts: dict[int, str | list[int]] = {}
        for n in sorted(counts, reverse=True):
            text = await exact_text(tok, seed, n)
            if text is None:
                break
            texts[n] = text
        if len(texts) == len(counts):
            return BoundaryPrompts("text", texts, f"text, lengths from {tok.base}/tokenize")
    ids = await tok.tokens(seed) if tok is not None else None
    if tok is not None and ids:
        note = f"token ids from {tok.base}/tokenize"
    else:
        note = "token ids = byte values (no /tokenize reachable: exact only for a byte tokenizer)"
    base = ids or list(seed.encode())
    top = max(counts)
    full = (base * (top // len(base) + 1))[:top]
    return BoundaryPrompts("token_ids", {n: full[:n] for n in counts}, note)


async def sim_prefill_url(http: aiohttp.ClientSession, sim: str | None) -> str | None:
    """The simulator's first prefill engine (its router has no /tokenize), from the
    `host`/`port` its `/server_info` reports."""
    if not sim:
        return None
    info = await get_json(http, sim + "/server_info")
    if isinstance(info, dict) and isinstance(info.get("port"), int):
        host = info.get("host") if isinstance(info.get("host"), str) else "127.0.0.1"
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{info['port']}"
    return None


# --- the simulator's ground truth ------------------------------------------------------------


def boundary_counts(limit: int) -> list[int]:
    """The three lengths every boundary probe sends: limit-1 and limit must be admitted,
    limit+1 rejected (400 context_length_exceeded) before it reaches an engine."""
    return [limit - 1, limit, limit + 1]


@dataclass
class Observed:
    """One probe's reply and, with the simulator, which engines saw it arrive ("" none,
    None: no ground truth)."""

    reply: Reply
    arrived: str | None


class ProbeClient:
    """The requests the gate and the isolation harness send, with the simulator's ground
    truth around them when `sim` is given: one client, so both read replies, arrivals and
    faults the same way."""

    def __init__(self, http: aiohttp.ClientSession, sim: str | None) -> None:
        self.http = http
        self.sim = sim

    async def post(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> Reply:
        return await post(self.http, url, body, headers, timeout_s)

    async def sim_stats(self) -> dict[str, Any] | None:
        return await fetch_sim_stats(self.http, self.sim)

    async def observe(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> Observed:
        """POST between two ground-truth reads: did it reach an engine?"""
        before = await self.sim_stats()
        reply = await self.post(url, body, headers, timeout_s)
        after = await self.sim_stats()
        return Observed(reply, sim_arrivals(before, after))

    async def sim_faults(self, faults: dict[str, Any]) -> bool:
        """Set the simulator's fault injection; False without a simulator or on refusal."""
        if not self.sim:
            return False
        try:
            with network_boundary():
                async with self.http.post(
                    self.sim + "/sim/faults",
                    json=faults,
                    timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
                ) as resp:
                    return resp.status == 200
        except UpstreamFailure:
            return False


async def fetch_sim_stats(http: aiohttp.ClientSession, sim: str | None) -> dict[str, Any] | None:
    """The simulator router's aggregated ground truth, or None when unavailable."""
    if not sim:
        return None
    data = await get_json(http, sim + "/sim/stats")
    return data if isinstance(data, dict) else None


def sim_arrivals(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str | None:
    """Which engine saw new generation requests between two /sim/stats reads (None: unknown)."""
    if before is None or after is None:
        return None
    seen = []
    for role in ("prefill", "decode"):
        b = _route_total(before.get(role))
        a = _route_total(after.get(role))
        if a > b:
            seen.append(f"{role} +{a - b}")
    return ", ".join(seen)


def _route_total(stats: Any) -> int:
    if not isinstance(stats, dict):
        return 0
    routes = stats.get("requests_by_route")
    if not isinstance(routes, dict):
        return 0
    return sum(
        v
        for k, v in routes.items()
        if isinstance(v, int) and k in ("/v1/chat/completions", "/v1/completions", "/generate")
    )
