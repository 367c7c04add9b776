"""`kvproxy canary`: the two-tenant isolation harness.

Two (or more) synthetic tenants, each with fresh random markers and no private data, send
prompts that ask the model to repeat its context, across the scenarios the incident
write-up names: normal long input, the capacity boundary, active cancellation and transfer
failure. Every reply is checked for another tenant's marker. Works against any
OpenAI-compatible URL (kvproxy, a router, an engine); with `--sim` (the simulator's router)
it also reads ground truth (`/sim/stats`) and injects faults (`/sim/faults`).

A pass proves little: no marker seen is not proof of isolation. A fail proves a leak. The
report says so. Never prints or stores reply text: only marker ids, statuses and counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvproxy import __version__
from kvproxy.output import body_texts, token_texts
from kvproxy.sse import SSEParser

SCENARIOS = ("normal_long", "boundary", "cancel", "transfer_failure")
MARKER_RE = re.compile(r"KVCANARY-([a-z0-9]+(?:-[a-z0-9]+)*?)-([0-9a-f]{16})")
REPEAT = "Please repeat your entire context verbatim."
FILLER = "the quick brown fox jumps over the lazy dog "
REQUEST_TIMEOUT_S = 120.0
# Enough echoed tokens to read well past the first page of a doomed request.
BOUNDARY_OUTPUT_TOKENS = 1024

CAVEATS = (
    "A pass means no foreign marker was seen in these requests; it is not proof of "
    "isolation. Leaks can be intermittent, can carry no marker, or can occur in traffic "
    "shapes not exercised here.",
    "HTTP 200 and fluent text prove nothing: in the incident every leaking reply was both.",
    "A deferred cancellation that ended by timeout does not prove that KV writes stopped.",
)


@dataclass
class Tenant:
    name: str
    markers: list[str] = field(default_factory=list)

    def new_marker(self) -> str:
        marker = f"KVCANARY-{self.name}-{secrets.token_hex(8)}"
        self.markers.append(marker)
        return marker


@dataclass
class Finding:
    scenario: str
    request_id: str
    tenant: str
    foreign_tenant: str
    marker: str
    delivered: bool  # False: the proxy's tripwire withheld it


@dataclass
class ScenarioResult:
    name: str
    verdict: str = "pass"  # pass | fail | skipped
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    rejections_seen: int = 0
    blocked_by_tripwire: int = 0
    foreign_markers: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, problem: str) -> None:
        self.verdict = "fail"
        self.problems.append(problem)


@dataclass
class CanaryOptions:
    target: str
    sim: str | None = None
    scenarios: tuple[str, ...] = SCENARIOS
    tenants: tuple[str, ...] = ("canary-a", "canary-b")
    tenant_header: str = "X-Tenant-ID"
    api_key: str | None = None
    model: str = "default"
    limit: int | None = None
    rounds: int = 4
    seed: int = 0
    prompt_chars: int | None = None
    progress: Callable[[str], None] = field(default=lambda line: None)


@dataclass
class CanaryReport:
    schema: str
    kvproxy_version: str
    target: str
    sim: str | None
    started_at: float
    finished_at: float
    tenants: list[str]
    limit_tokens: int | None
    limit_source: str | None
    scenarios: list[ScenarioResult]
    verdict: str
    caveats: tuple[str, ...] = CAVEATS

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Reply:
    status: int
    code: str | None
    texts: list[str]
    blocked: bool
    decision: str | None
    error: str | None = None


class Harness:
    def __init__(self, opts: CanaryOptions, http: aiohttp.ClientSession) -> None:
        self.opts = opts
        self.http = http
        self.rng = random.Random(opts.seed)
        self.tenants = [Tenant(name) for name in opts.tenants]
        self.limit: int | None = opts.limit
        self.limit_source: str | None = "--limit" if opts.limit else None
        self._seq = 0

    # --- requests -----------------------------------------------------------------------

    def _headers(self, tenant: Tenant) -> dict[str, str]:
        h = {"Content-Type": "application/json", self.opts.tenant_header: tenant.name}
        if self.opts.api_key:
            h["Authorization"] = f"Bearer {self.opts.api_key}"
        return h

    def _request_id(self, scenario: str) -> str:
        self._seq += 1
        return f"canary-{scenario}-{self._seq}"

    def long_prompt(self, tenant: Tenant, chars: int) -> str:
        """A prompt of about `chars` characters with this tenant's marker every ~200
        characters, so any page of it that leaks carries a marker."""
        marker = tenant.new_marker()
        unit = f"Tenant {tenant.name} secret {marker}. {FILLER}{FILLER}{FILLER}"
        tail = f" {REPEAT}"
        body = (unit * (max(0, chars - len(tail)) // len(unit) + 1))[: max(0, chars - len(tail))]
        return body + tail

    async def chat(
        self, tenant: Tenant, content: str, rid: str, *, stream: bool, max_tokens: int
    ) -> Reply:
        body = {
            "model": self.opts.model,
            "stream": stream,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        }
        return await self._post("/v1/chat/completions", tenant, body, rid)

    async def completion_ids(
        self, tenant: Tenant, ids: list[int], rid: str, max_tokens: int
    ) -> Reply:
        body = {"model": self.opts.model, "prompt": ids, "max_tokens": max_tokens}
        return await self._post("/v1/completions", tenant, body, rid)

    async def _post(self, path: str, tenant: Tenant, body: dict[str, Any], rid: str) -> Reply:
        headers = self._headers(tenant) | {"X-Request-ID": rid}
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        try:
            async with self.http.post(
                self.opts.target + path, data=orjson.dumps(body), headers=headers, timeout=timeout
            ) as resp:
                raw = await resp.read()
                return _parse_reply(resp.status, resp.headers, raw)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Reply(0, None, [], False, None, error=type(exc).__name__)

    def check(self, result: ScenarioResult, tenant: Tenant, rid: str, reply: Reply) -> None:
        result.requests += 1
        key = str(reply.status) if reply.status else (reply.error or "error")
        result.statuses[key] = result.statuses.get(key, 0) + 1
        if reply.status == 400 and reply.code == "context_length_exceeded":
            result.rejections_seen += 1
        if reply.blocked:
            result.blocked_by_tripwire += 1
        for text in reply.texts:
            for m in MARKER_RE.finditer(text):
                owner = m.group(1)
                if owner != tenant.name:
                    result.foreign_markers.append(
                        Finding(result.name, rid, tenant.name, owner, m.group(0), True)
                    )
        if any(f.request_id == rid for f in result.foreign_markers):
            result.fail(f"{rid}: tenant {tenant.name} received another tenant's marker")

    # --- ground truth -------------------------------------------------------------------

    async def sim_stats(self) -> dict[str, Any] | None:
        if not self.opts.sim:
            return None
        try:
            async with self.http.get(self.opts.sim + "/sim/stats") as resp:
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    async def sim_faults(self, faults: dict[str, Any]) -> bool:
        if not self.opts.sim:
            return False
        try:
            async with self.http.post(self.opts.sim + "/sim/faults", json=faults) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def discover_limit(self) -> None:
        """The limit to probe: --limit, else the simulator's prefill report."""
        if self.limit is not None or not self.opts.sim:
            return
        try:
            async with self.http.get(self.opts.sim + "/server_info") as resp:
                info = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return
        mril = info.get("max_req_input_len") if isinstance(info, dict) else None
        if isinstance(mril, int) and mril > 1:
            # SGLang refuses len >= max_req_input_len: the largest accepted prompt is one less.
            self.limit = mril - 1
            self.limit_source = "sim /server_info max_req_input_len - 1"

    async def ids_for(self, text: str, n: int) -> list[int]:
        bases = [b for b in (self.opts.sim, self.opts.target) if b]
        return await token_ids(self.http, bases, text, n)

    # --- scenarios ----------------------------------------------------------------------

    def _chars(self) -> int:
        if self.opts.prompt_chars:
            return self.opts.prompt_chars
        # Worst case one token per byte (the simulator's byte tokenizer): stay well under.
        return max(200, int((self.limit or 4000) * 0.4))

    async def normal_long(self, r: ScenarioResult) -> None:
        for i in range(self.opts.rounds):
            for t in self.tenants:
                rid = self._request_id(r.name)
                prompt = self.long_prompt(t, self._chars())
                reply = await self.chat(t, prompt, rid, stream=i % 2 == 0, max_tokens=len(prompt))
                self.check(r, t, rid, reply)
                if reply.status != 200 and not reply.blocked:
                    r.notes.append(f"{rid}: status {reply.status or reply.error}")

    async def boundary(self, r: ScenarioResult) -> None:
        if self.limit is None:
            r.verdict = "skipped"
            r.notes.append("limit unknown: pass --limit N or --sim URL")
            return
        a, b = self.tenants[0], self.tenants[1]
        marker = b.new_marker()
        text = f"Tenant {b.name} boundary {marker}. {REPEAT} "
        for delta, expect_admit in ((-1, True), (0, True), (1, False)):
            if not expect_admit:
                # Right before the over-limit probe, fill the pool with tenant A's data:
                # pages freed last are handed out first, so a stale read shows A's markers.
                for _ in range(2):
                    rid = self._request_id(r.name)
                    prompt = self.long_prompt(a, self._chars())
                    reply = await self.chat(a, prompt, rid, stream=False, max_tokens=len(prompt))
                    self.check(r, a, rid, reply)
            n = self.limit + delta
            ids = await self.ids_for(text, n)
            rid = self._request_id(r.name)
            before = await self.sim_stats()
            reply = await self.completion_ids(b, ids, rid, max_tokens=BOUNDARY_OUTPUT_TOKENS)
            after = await self.sim_stats()
            self.check(r, b, rid, reply)
            label = f"limit{delta:+d} ({n} tokens)"
            if expect_admit:
                if reply.status == 400:
                    r.notes.append(f"{label}: rejected (over-strict: a legal prompt refused)")
                elif reply.status != 200:
                    r.notes.append(f"{label}: status {reply.status or reply.error}")
                continue
            if reply.status == 200:
                r.fail(f"{label}: admitted and generated; must be rejected before the engine")
            elif reply.status != 400 or reply.code != "context_length_exceeded":
                r.fail(
                    f"{label}: expected 400 context_length_exceeded, got "
                    f"{reply.status or reply.error} {reply.code}"
                )
            arrived = sim_arrivals(before, after)
            if arrived is None:
                r.notes.append(f"{label}: no simulator ground truth (pass --sim)")
            elif arrived:
                r.fail(f"{label}: reached the engines ({arrived}); a rejection must send nothing")
            else:
                r.notes.append(f"{label}: simulator confirms it never arrived")

    async def cancel(self, r: ScenarioResult) -> None:
        """Disconnect during prefill, during the KV transfer and during decode, each time
        with the other tenant sending right after: the window in which a decode engine
        that frees pages on abort hands them to the next request while writes land."""
        a, b = self.tenants[0], self.tenants[1]
        long_chars = max(200, int((self.limit or 4000) * 0.9))
        short_chars = max(200, int((self.limit or 4000) * 0.2))
        phases = ("transfer", "prefill", "decode")
        for i in range(self.opts.rounds * len(phases)):
            phase = phases[i % len(phases)]
            victim, other = (a, b) if (i // len(phases)) % 2 == 0 else (b, a)
            rid = self._request_id(r.name)
            prompt = self.long_prompt(victim, long_chars)
            await self._disconnect_during(victim, prompt, rid, phase)
            r.requests += 1
            key = f"disconnected_{phase}"
            r.statuses[key] = r.statuses.get(key, 0) + 1
            rid2 = self._request_id(r.name)
            p2 = self.long_prompt(other, short_chars)
            reply = await self.chat(other, p2, rid2, stream=False, max_tokens=len(p2))
            self.check(r, other, rid2, reply)

    async def _disconnect_during(self, tenant: Tenant, prompt: str, rid: str, phase: str) -> None:
        body = {
            "model": self.opts.model,
            "stream": True,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": prompt}],
        }
        headers = self._headers(tenant) | {"X-Request-ID": rid}
        started = await self._transfers_started()
        first_byte = asyncio.Event()

        async def go() -> None:
            async with self.http.post(
                self.opts.target + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers=headers,
            ) as resp:
                async for chunk in resp.content.iter_any():
                    if b'"content"' in chunk or b'"text"' in chunk:
                        first_byte.set()

        task = asyncio.ensure_future(go())
        try:
            if phase == "decode":
                await asyncio.wait_for(first_byte.wait(), REQUEST_TIMEOUT_S)
            elif phase == "transfer" and started is not None:
                # Ground truth says when decode starts receiving pages: leave then.
                for _ in range(2000):
                    now = await self._transfers_started()
                    if task.done() or now is None or now > started:
                        break
                    await asyncio.sleep(0.002)
            else:
                await asyncio.sleep(self.rng.uniform(0.005, 0.05))
        except (TimeoutError, aiohttp.ClientError):
            pass
        if not task.done():
            task.cancel()  # closes the connection: the client has gone
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, TimeoutError):
            await task

    async def _transfers_started(self) -> int | None:
        stats = await self.sim_stats()
        decode = stats.get("decode") if stats else None
        if isinstance(decode, dict) and isinstance(decode.get("transfers_started"), int):
            return int(decode["transfers_started"])
        return None

    async def transfer_failure(self, r: ScenarioResult) -> None:
        if not self.opts.sim:
            r.verdict = "skipped"
            r.notes.append("needs the simulator's fault API (--sim URL); skipped")
            return
        a, b = self.tenants[0], self.tenants[1]
        chars = self._chars()
        try:
            for i in range(self.opts.rounds):
                owner, victim = (b, a) if i % 2 == 0 else (a, b)
                await self.sim_faults({"transfer_failure_probability": 0.0})
                rid = self._request_id(r.name)
                prompt = self.long_prompt(owner, chars)
                self.check(
                    r,
                    owner,
                    rid,
                    await self.chat(owner, prompt, rid, stream=False, max_tokens=len(prompt)),
                )
                if not await self.sim_faults({"transfer_failure_probability": 1.0}):
                    r.verdict = "skipped"
                    r.notes.append("the simulator refused the fault injection")
                    return
                rid = self._request_id(r.name)
                prompt = self.long_prompt(victim, chars)
                reply = await self.chat(
                    victim, prompt, rid, stream=i % 2 == 0, max_tokens=len(prompt)
                )
                self.check(r, victim, rid, reply)
                if reply.blocked:
                    r.notes.append(f"{rid}: foreign data withheld by kvproxy's tripwire")
        finally:
            await self.sim_faults({"transfer_failure_probability": 0.0})

    async def run(self) -> CanaryReport:
        started = time.time()
        await self.discover_limit()
        runners: dict[str, Callable[[ScenarioResult], Awaitable[None]]] = {
            "normal_long": self.normal_long,
            "boundary": self.boundary,
            "cancel": self.cancel,
            "transfer_failure": self.transfer_failure,
        }
        results = []
        for name in self.opts.scenarios:
            r = ScenarioResult(name)
            self.opts.progress(f"[canary] {name} ...")
            await runners[name](r)
            if r.foreign_markers and r.verdict != "fail":
                r.fail("foreign markers found")
            answered = sum(v for k, v in r.statuses.items() if k in ("200", "400"))
            if r.verdict == "pass" and r.requests and not answered:
                # Nothing came back: the scenario observed nothing and proves nothing.
                r.fail(f"no request was answered ({r.statuses}); is the target reachable?")
            self.opts.progress(
                f"[canary] {name}: {r.verdict.upper()} ({r.requests} requests, "
                f"{len(r.foreign_markers)} foreign markers, {r.blocked_by_tripwire} blocked)"
            )
            results.append(r)
        verdict = "fail" if any(r.verdict == "fail" for r in results) else "pass"
        return CanaryReport(
            schema="kvproxy.canary/1",
            kvproxy_version=__version__,
            target=self.opts.target,
            sim=self.opts.sim,
            started_at=started,
            finished_at=time.time(),
            tenants=[t.name for t in self.tenants],
            limit_tokens=self.limit,
            limit_source=self.limit_source,
            scenarios=results,
            verdict=verdict,
        )


async def token_ids(http: aiohttp.ClientSession, bases: list[str], text: str, n: int) -> list[int]:
    """Exactly n token ids spelling (a repetition of) `text` in the engine's tokenizer.

    Token-id prompts make a probe's length exact for kvproxy and the engine alike, with no
    tokenizer on this side. The ids come from the first `/tokenize` that answers; byte
    values are the fallback (right for the simulator's byte tokenizer).
    """
    ids: list[int] | None = None
    for base in bases:
        try:
            async with http.post(base + "/tokenize", json={"prompt": text}) as resp:
                data = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
        toks = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(toks, list) and toks and all(isinstance(t, int) for t in toks):
            ids = toks
            break
    if ids is None:
        ids = list(text.encode())
    return (ids * (n // len(ids) + 1))[:n]


async def fetch_sim_stats(http: aiohttp.ClientSession, sim: str | None) -> dict[str, Any] | None:
    """The simulator router's aggregated ground truth, or None when unavailable."""
    if not sim:
        return None
    try:
        async with http.get(sim + "/sim/stats") as resp:
            data = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
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


def _parse_reply(status: int, headers: Any, raw: bytes) -> Reply:
    decision = headers.get("X-Kvproxy-Decision")
    ctype = headers.get("Content-Type", "")
    code: str | None = None
    texts: list[str] = []
    blocked = False
    if ctype.startswith("text/event-stream"):
        parser = SSEParser()
        per_index: dict[int, list[str]] = {}
        for payload in parser.feed(raw):
            if b'"canary_violation"' in payload:
                blocked = True
            for index, text in token_texts(payload):
                per_index.setdefault(index, []).append(text)
        texts = ["".join(parts) for parts in per_index.values()]
    else:
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict):
                code = err.get("code") if isinstance(err.get("code"), str) else None
            elif isinstance(data.get("kvproxy_code"), str):
                code = data["kvproxy_code"]
            blocked = code == "canary_violation"
        texts = body_texts(raw) if status == 200 else []
    return Reply(status, code, texts, blocked, decision)


# --- CLI ----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="OpenAI-compatible base URL to test")
    p.add_argument("--sim", help="the simulator's router URL: ground truth and fault injection")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--tenants", default="canary-a,canary-b", help="synthetic tenant ids")
    p.add_argument("--tenant-header", default="X-Tenant-ID")
    p.add_argument("--api-key", help="bearer token for the target, if it needs one")
    p.add_argument("--model", default="default")
    p.add_argument("--limit", type=int, help="the admission limit to probe (inclusive tokens)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="write the JSON report here")


def options_from(args: argparse.Namespace, progress: Callable[[str], None]) -> CanaryOptions:
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"kvproxy canary: unknown scenario(s) {unknown}; known: {SCENARIOS}")
    tenants = tuple(t.strip().lower() for t in args.tenants.split(",") if t.strip())
    if len(tenants) < 2 or any(not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", t) for t in tenants):
        raise SystemExit("kvproxy canary: --tenants needs two or more ids of [a-z0-9-]")
    return CanaryOptions(
        target=args.target.rstrip("/"),
        sim=args.sim.rstrip("/") if args.sim else None,
        scenarios=scenarios,
        tenants=tenants,
        tenant_header=args.tenant_header,
        api_key=args.api_key,
        model=args.model,
        limit=args.limit,
        rounds=max(1, min(args.rounds, 50)),
        seed=args.seed,
        progress=progress,
    )


async def run_isolation(opts: CanaryOptions) -> CanaryReport:
    async with aiohttp.ClientSession() as http:
        return await Harness(opts, http).run()


def summary(report: CanaryReport) -> str:
    lines = [f"kvproxy canary against {report.target}: {report.verdict.upper()}"]
    if report.limit_tokens is not None:
        lines.append(f"  limit probed: {report.limit_tokens:,} tokens ({report.limit_source})")
    for r in report.scenarios:
        lines.append(
            f"  {r.name:<17} {r.verdict.upper():<7} requests={r.requests} "
            f"rejections={r.rejections_seen} foreign_markers={len(r.foreign_markers)} "
            f"blocked={r.blocked_by_tripwire}"
        )
        lines.extend(f"      ! {p}" for p in r.problems[:10])
        lines.extend(f"      - {n}" for n in r.notes[:10])
    lines.append("  note: " + CAVEATS[0])
    return "\n".join(lines)


def run_canary(args: argparse.Namespace) -> int:
    opts = options_from(args, lambda line: print(line, file=sys.stderr, flush=True))
    report = asyncio.run(run_isolation(opts))
    if args.report:
        Path(args.report).write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2))
    print(summary(report))
    return 0 if report.verdict == "pass" else 1
