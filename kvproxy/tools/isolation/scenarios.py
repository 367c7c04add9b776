"""The isolation scenarios `kvproxy canary` runs, and the tenants and findings they record.

Two (or more) synthetic tenants, each with fresh random markers and no private data, send
prompts that ask the model to repeat its context, across the scenarios the incident
write-up names: normal long input, the capacity boundary, active cancellation and transfer
failure. Every reply is checked for another tenant's marker.

Owns: what each scenario sends and how it judges the replies. A reply that is an error the
scenario did not expect stops the scenario at once (`TargetRefused`, with status and code):
nothing that follows could observe anything. Every wait is bounded by a named timeout.
Never prints or stores reply text: only marker ids, statuses and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import orjson

from kvproxy.policy import UpstreamFailure
from kvproxy.tools.client import (
    REQUEST_TIMEOUT_S,
    Observed,
    ProbeChoice,
    ProbeClient,
    Reply,
    TargetRefused,
    boundary_counts,
    boundary_prompts,
    parse_reply,
)
from kvproxy.upstream import network_boundary

SCENARIOS = ("normal_long", "boundary", "cancel", "transfer_failure")
# Scenarios that need the simulator's fault API (--sim) and nothing else can stand in for it:
# a real engine offers no safe way to make a KV transfer fail on demand (vLLM 0.32's
# NixlConnector reads no fault-injection setting; its only environment knobs are the side
# channel's host and port). Without --sim such a scenario is "not run" with this reason and
# does not make the run incomplete: it cannot run on a real stack, which is not a gap the
# operator can close (kvproxy.tools.isolation.harness.run_verdict).
NEEDS_SIM_FAULTS = frozenset({"transfer_failure"})
NEEDS_SIM_REASON = (
    "needs the simulator's fault API (--sim URL): no real engine offers a safe hook to fail "
    "a KV transfer (vLLM 0.32's NixlConnector has none); not run on this stack"
)
MARKER_RE = re.compile(r"KVCANARY-([a-z0-9]+(?:-[a-z0-9]+)*?)-([0-9a-f]{16})")
REPEAT = "Please repeat your entire context verbatim."
FILLER = "the quick brown fox jumps over the lazy dog "
# The over-limit probe: enough echoed tokens to read well past the first page of a doomed
# request. The legal probes ask for one token: the published limit is the largest prompt
# served with at least one output token (kvproxy.capacity.limits), so more output would
# probe the decode budget, not the limit.
BOUNDARY_OUTPUT_TOKENS = 1024
LEGAL_PROBE_OUTPUT_TOKENS = 1
# `cancel`: how long to wait for the first streamed token before leaving "during decode".
FIRST_TOKEN_TIMEOUT_S = 30.0
# `cancel`: how long to wait for ground truth to show decode receiving pages.
TRANSFER_START_TIMEOUT_S = 10.0
Verdict = Literal["pass", "fail", "over_strict", "skipped"]
# The harness's synthetic tenants and the header that names them, unless told otherwise.
DEFAULT_TENANTS = ("canary-a", "canary-b")
DEFAULT_TENANT_HEADER = "X-Tenant-ID"


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
    # over_strict: the boundary refused a legal prompt (the published limit is unreachable)
    verdict: Verdict = "pass"
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    rejections_seen: int = 0
    blocked_by_tripwire: int = 0
    foreign_markers: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    probe_kind: str | None = None  # boundary: "text" or "token_ids"
    kvproxy_answered: bool = False  # some reply carried X-Kvproxy-Decision

    def fail(self, problem: str) -> None:
        self.verdict = "fail"
        self.problems.append(problem)


@dataclass
class CanaryOptions:
    target: str
    sim: str | None = None
    engine: str | None = None  # an engine URL whose /tokenize measures the probes
    proxy_admin: str | None = None  # kvproxy's admin URL: says whether the tripwire is armed
    scenarios: tuple[str, ...] = SCENARIOS
    tenants: tuple[str, ...] = DEFAULT_TENANTS
    tenant_header: str = DEFAULT_TENANT_HEADER
    api_key: str | None = None
    model: str | None = None  # None: the target's /v1/models
    limit: int | None = None
    rounds: int = 4
    seed: int = 0
    prompt_chars: int | None = None
    probe_kind: ProbeChoice = "auto"
    # The operator accepts a run that did not run every scenario: its verdict still says
    # incomplete, but the command exits 0 (kvproxy.tools.isolation.cli).
    allow_partial: bool = False
    progress: Callable[[str], None] = field(default=lambda line: None)


class Harness:
    def __init__(self, opts: CanaryOptions, http: aiohttp.ClientSession, model: str) -> None:
        self.opts = opts
        self.http = http
        self.client = ProbeClient(http, opts.sim)
        self.model = model
        self.rng = random.Random(opts.seed)
        self.tenants = [Tenant(name) for name in opts.tenants]
        self.limit: int | None = opts.limit
        self.tokenizer_bases: list[str] = []
        self._seq = 0

    # --- requests -----------------------------------------------------------------------

    def headers(self, tenant: Tenant, rid: str) -> dict[str, str]:
        h = {self.opts.tenant_header: tenant.name, "X-Request-ID": rid}
        if self.opts.api_key:
            h["Authorization"] = f"Bearer {self.opts.api_key}"
        return h

    def request_id(self, scenario: str) -> str:
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
            "model": self.model,
            "stream": stream,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        }
        url = self.opts.target + "/v1/chat/completions"
        return await self.client.post(url, body, self.headers(tenant, rid))

    async def completion(
        self, tenant: Tenant, prompt: str | list[int], rid: str, max_tokens: int
    ) -> Observed:
        """A completion between two ground-truth reads (did it reach an engine?)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        url = self.opts.target + "/v1/completions"
        return await self.client.observe(url, body, self.headers(tenant, rid))

    def check(
        self, r: ScenarioResult, tenant: Tenant, rid: str, reply: Reply, *, errors_ok: bool = False
    ) -> None:
        """Count the reply, collect foreign markers, and stop the scenario (TargetRefused)
        when the target refused it for a reason the scenario did not expect."""
        r.requests += 1
        key = str(reply.status) if reply.status else (reply.error or "error")
        r.statuses[key] = r.statuses.get(key, 0) + 1
        r.kvproxy_answered = r.kvproxy_answered or reply.decision is not None
        if reply.context_length_exceeded:
            r.rejections_seen += 1
        if reply.blocked:
            r.blocked_by_tripwire += 1
        for text in reply.texts:
            for m in MARKER_RE.finditer(text):
                if m.group(1) != tenant.name:
                    r.foreign_markers.append(
                        Finding(r.name, rid, tenant.name, m.group(1), m.group(0), True)
                    )
        if any(f.request_id == rid for f in r.foreign_markers):
            r.fail(f"{rid}: tenant {tenant.name} received another tenant's marker")
        if reply.refused() and not errors_ok:
            raise TargetRefused(f"{r.name} request {rid}", reply)

    # --- scenarios ----------------------------------------------------------------------

    def _chars(self) -> int:
        if self.opts.prompt_chars:
            return self.opts.prompt_chars
        # Worst case one token per byte (the simulator's byte tokenizer): stay well under.
        return max(200, int((self.limit or 4000) * 0.4))

    async def normal_long(self, r: ScenarioResult) -> None:
        for i in range(self.opts.rounds):
            for t in self.tenants:
                rid = self.request_id(r.name)
                prompt = self.long_prompt(t, self._chars())
                reply = await self.chat(t, prompt, rid, stream=i % 2 == 0, max_tokens=len(prompt))
                self.check(r, t, rid, reply)

    async def boundary(self, r: ScenarioResult) -> None:
        if self.limit is None:
            r.verdict = "skipped"
            r.notes.append("limit unknown: pass --proxy-admin URL, --limit N or --sim URL")
            return
        a, b = self.tenants[0], self.tenants[1]
        seed = f"Tenant {b.name} boundary {b.new_marker()}. {REPEAT} " + FILLER * 8
        counts = boundary_counts(self.limit)
        probes = await boundary_prompts(
            self.http, self.tokenizer_bases, seed, counts, self.opts.probe_kind
        )
        r.probe_kind = probes.kind
        r.notes.append(f"probes: {probes.note}")
        refused_legal: list[str] = []
        for n, expect_admit in zip(counts, (True, True, False), strict=True):
            if not expect_admit:
                # Right before the over-limit probe, fill the pool with tenant A's data:
                # pages freed last are handed out first, so a stale read shows A's markers.
                for _ in range(2):
                    rid = self.request_id(r.name)
                    prompt = self.long_prompt(a, self._chars())
                    reply = await self.chat(a, prompt, rid, stream=False, max_tokens=len(prompt))
                    self.check(r, a, rid, reply)
            rid = self.request_id(r.name)
            label = f"limit{n - self.limit:+d} ({n} tokens)"
            out = LEGAL_PROBE_OUTPUT_TOKENS if expect_admit else BOUNDARY_OUTPUT_TOKENS
            seen = await self.completion(b, probes.prompts[n], rid, out)
            reply, arrived = seen.reply, seen.arrived
            self.check(r, b, rid, reply)
            if expect_admit:
                if reply.context_length_exceeded:
                    refused_legal.append(label)
                continue
            if reply.status == 200:
                r.fail(f"{label}: admitted and generated; must be rejected before the engine")
            elif not reply.context_length_exceeded:
                r.fail(f"{label}: expected 400 context_length_exceeded, got {reply.describe()}")
            if arrived is None:
                r.notes.append(f"{label}: no simulator ground truth (pass --sim)")
            elif arrived:
                r.fail(f"{label}: reached the engines ({arrived}); a rejection must send nothing")
            else:
                r.notes.append(f"{label}: simulator confirms it never arrived")
        if refused_legal:
            msg = f"{', '.join(refused_legal)} refused with 400 context_length_exceeded"
            r.problems.append(f"over-strict: a legal prompt was refused ({msg})")
            if r.verdict == "pass":
                r.verdict = "over_strict"
        elif r.verdict == "pass":
            r.notes.append("limit-1 and limit admitted, limit+1 rejected")

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
            rid = self.request_id(r.name)
            await self._disconnect_during(
                r, victim, self.long_prompt(victim, long_chars), rid, phase
            )
            r.requests += 1
            key = f"disconnected_{phase}"
            r.statuses[key] = r.statuses.get(key, 0) + 1
            rid2 = self.request_id(r.name)
            p2 = self.long_prompt(other, short_chars)
            reply = await self.chat(other, p2, rid2, stream=False, max_tokens=len(p2))
            self.check(r, other, rid2, reply)

    async def _disconnect_during(
        self, r: ScenarioResult, tenant: Tenant, prompt: str, rid: str, phase: str
    ) -> None:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": prompt}],
        }
        headers = {"Content-Type": "application/json", **self.headers(tenant, rid)}
        started = await self._transfers_started()
        first_byte = asyncio.Event()
        refused: list[Reply] = []

        async def go() -> None:
            with network_boundary():
                async with self.http.post(
                    self.opts.target + "/v1/chat/completions",
                    data=orjson.dumps(body),
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                ) as resp:
                    if resp.status != 200:
                        # An error answer ends the request: record it, nothing to leave from.
                        refused.append(parse_reply(resp.status, resp.headers, await resp.read()))
                        return
                    async for chunk in resp.content.iter_any():
                        if b'"content"' in chunk or b'"text"' in chunk:
                            first_byte.set()

        task = asyncio.ensure_future(go())
        # Nothing here raises a transport error: the ground-truth reads (get_json) answer
        # None instead, and the request's own failure stays inside `task`.
        if phase == "decode":
            # Whichever comes first: the first token, or the request ending without one.
            waiter = asyncio.ensure_future(first_byte.wait())
            await asyncio.wait(
                {waiter, task},
                timeout=FIRST_TOKEN_TIMEOUT_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        elif phase == "transfer" and started is not None:
            # Ground truth says when decode starts receiving pages: leave then.
            deadline = time.monotonic() + TRANSFER_START_TIMEOUT_S
            for _ in range(5000):
                now = await self._transfers_started()
                if task.done() or now is None or now > started:
                    break
                if time.monotonic() > deadline:
                    r.notes.append(
                        f"{rid}: no transfer started within "
                        f"{TRANSFER_START_TIMEOUT_S:.0f} s; left anyway"
                    )
                    break
                await asyncio.sleep(0.002)
        else:
            await asyncio.sleep(self.rng.uniform(0.005, 0.05))
        if not task.done():
            task.cancel()  # closes the connection: the client has gone
        # The leg's own failure (reset, timeout) is the point of the scenario, not an error.
        with contextlib.suppress(asyncio.CancelledError, UpstreamFailure):
            await task
        if refused and refused[0].refused():
            raise TargetRefused(f"{r.name} request {rid}", refused[0])

    async def _transfers_started(self) -> int | None:
        stats = await self.client.sim_stats()
        decode = stats.get("decode") if stats else None
        if isinstance(decode, dict) and isinstance(decode.get("transfers_started"), int):
            return int(decode["transfers_started"])
        return None

    async def transfer_failure(self, r: ScenarioResult) -> None:
        if not self.opts.sim:
            r.verdict = "skipped"
            r.notes.append(NEEDS_SIM_REASON)
            return
        a, b = self.tenants[0], self.tenants[1]
        chars = self._chars()
        try:
            for i in range(self.opts.rounds):
                owner, victim = (b, a) if i % 2 == 0 else (a, b)
                await self.client.sim_faults({"transfer_failure_probability": 0.0})
                rid = self.request_id(r.name)
                prompt = self.long_prompt(owner, chars)
                reply = await self.chat(owner, prompt, rid, stream=False, max_tokens=len(prompt))
                self.check(r, owner, rid, reply)
                if not await self.client.sim_faults({"transfer_failure_probability": 1.0}):
                    if r.verdict == "pass":  # a leak already seen stays a failure
                        r.verdict = "skipped"
                    r.notes.append("the simulator refused the fault injection")
                    return
                rid = self.request_id(r.name)
                prompt = self.long_prompt(victim, chars)
                reply = await self.chat(
                    victim, prompt, rid, stream=i % 2 == 0, max_tokens=len(prompt)
                )
                # A failed transfer reported as an error is the safe outcome, not a refusal.
                self.check(r, victim, rid, reply, errors_ok=True)
                if reply.blocked:
                    r.notes.append(f"{rid}: foreign data withheld by kvproxy's tripwire")
                elif reply.refused():
                    r.notes.append(f"{rid}: the failed transfer answered {reply.describe()}")
        finally:
            await self.client.sim_faults({"transfer_failure_probability": 0.0})
