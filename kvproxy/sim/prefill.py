"""The prefill engine: admission, bootstrap, forward pass and the KV sender.

Owns: the prefill half of a PD request. It checks the prompt against its own pool (the
SGLang arithmetic in ``limits.py``), answers decode's bootstrap handshake for the request's
``bootstrap_room``, waits for decode's destination pages, "computes" for a time that
scales with the prompt, then issues page writes to decode's NIC in batches and signals
"transfer done". Aborts stop new batches; batches already issued keep landing, and the
ABORT_ACK is sent only once they have.

The failure modes it owns, each behind a switch of ``EngineConfig``:
  pending_rejection_transfers  an over-limit prompt is swapped for a one-token placeholder,
                               one page is sent and "done" is signalled (the incident);
                               off: 400 at admission, no bootstrap, no allocation, no transfer.
  failed_send_as_drained       an injected transfer failure is reported to decode as a
                               successful drain while its writes are still in flight;
                               off: decode is told it failed, and acked once writes landed.

Independent oracle: never imports kvproxy code outside ``kvproxy/sim``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvproxy.sim.checksum import kv_digest
from kvproxy.sim.engine import EngineServer
from kvproxy.sim.limits import EngineError, pool_refusal
from kvproxy.sim.protocol import SSE_DONE, GenRequest, StreamShaper, full_reply, sse

# The token SGLang's scheduler puts in place of a prompt it has marked for rejection.
PLACEHOLDER_TOKEN = 0
_REJECTED_MEMORY = 4096


@dataclass
class PrefillRoom:
    room: int
    compute_ids: list[int]
    dest: asyncio.Future[tuple[str, list[int]]]
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future[str] | None = None  # "ok" | "failed" | "aborted"
    error: str = ""
    decode_url: str | None = None
    inflight: set[asyncio.Task[Any]] = field(default_factory=set)
    pages: list[int] = field(default_factory=list)
    # The prompt's tokens while prefill works on it (compute and transfer): ground truth
    # for "prompt tokens in flight" (0 once given back).
    held_tokens: int = 0


class PrefillServer(EngineServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, PrefillRoom] = {}
        self.rejected: OrderedDict[int, str] = OrderedDict()
        self._room_waiters: dict[int, asyncio.Event] = {}
        self.inflight_transfers = 0
        self.waiting_bootstrap = 0
        # Prompt tokens of the requests prefill is working on, and the most ever at once
        # since the last reset: what an in-flight budget in front of the engines must bound.
        self.held_prompt_tokens = 0
        self.peak_held_prompt_tokens = 0

    def stats_json(self) -> dict[str, Any]:
        data = super().stats_json()
        data.update(
            prompt_tokens_in_flight=self.held_prompt_tokens,
            peak_prompt_tokens_in_flight=self.peak_held_prompt_tokens,
        )
        return data

    async def _sim_reset(self, request: web.Request) -> web.Response:
        self.peak_held_prompt_tokens = self.held_prompt_tokens
        return await super()._sim_reset(request)

    def _hold(self, state: PrefillRoom, tokens: int) -> None:
        state.held_tokens = tokens
        self.held_prompt_tokens += tokens
        self.peak_held_prompt_tokens = max(self.peak_held_prompt_tokens, self.held_prompt_tokens)

    def _give_back(self, state: PrefillRoom) -> None:
        # Before decode is told the transfer is over: everything a proxy can see of this
        # request's end (decode's first token, the response's end) comes after this.
        self.held_prompt_tokens -= state.held_tokens
        state.held_tokens = 0

    def add_routes(self, app: web.Application) -> None:
        super().add_routes(app)
        app.router.add_post("/sim/kv/handshake", self._handshake)
        app.router.add_post("/sim/kv/dest", self._dest)
        app.router.add_post("/sim/kv/abort", self._abort_room)

    # -- the generation request -------------------------------------------------------------

    async def serve(self, request: web.Request, req: GenRequest) -> web.StreamResponse:
        assert req.bootstrap_room is not None
        room = req.bootstrap_room
        n = len(req.input_ids)
        compute_ids = req.input_ids
        refusal = pool_refusal(self.limits, n, self.config.flavor)
        if refusal is not None:
            if not self.config.pending_rejection_transfers:
                self.stats.rejections_at_admission += 1
                self._remember_rejection(room, refusal)
                return await self.refuse(request, req, EngineError(refusal))
            # The incident: the request stays alive with a placeholder prompt.
            self.stats.pending_rejections += 1
            compute_ids = [PLACEHOLDER_TOKEN]
        loop = asyncio.get_running_loop()
        state = PrefillRoom(room=room, compute_ids=compute_ids, dest=loop.create_future())
        state.result = loop.create_future()
        self.rooms[room] = state
        waiter = self._room_waiters.pop(room, None)
        if waiter is not None:
            waiter.set()
        self._hold(state, n)
        self.spawn(self._transfer(state))
        self.stats.prompt_tokens += len(compute_ids)
        resp: web.StreamResponse | None = None
        try:
            if req.stream:
                resp = await self.open_stream(request)
            outcome = await asyncio.shield(state.result)
        except (asyncio.CancelledError, ConnectionError):
            self._abort(state)
            self.stats.aborts += 1
            raise
        self.stats.requests_finished += 1
        if outcome != "ok":
            exc = EngineError(state.error or "Request aborted.", 500)
            if resp is None:
                return await self.refuse(request, req, exc)
            await self._write_stream_error(resp, req, exc)
            return resp
        if resp is None:
            return web.json_response(full_reply(req, "", len(compute_ids), [], "length"))
        shaper = StreamShaper(req, len(compute_ids))
        with contextlib.suppress(ConnectionError):
            for chunk in shaper.first():
                await resp.write(sse(chunk))
            await resp.write(sse(shaper.delta("", 0, "length")))
            await resp.write(SSE_DONE)
        return resp

    async def _write_stream_error(
        self, resp: web.StreamResponse, req: GenRequest, exc: EngineError
    ) -> None:
        from kvproxy.sim.limits import native_error_body, stream_error_event

        event = (
            native_error_body(exc.message)
            if req.route == "/generate"
            else stream_error_event(self.config.flavor, exc.message, exc.status)
        )
        with contextlib.suppress(ConnectionError):
            await resp.write(sse(event))
            await resp.write(SSE_DONE)

    def _abort(self, state: PrefillRoom) -> None:
        state.aborted.set()
        if self.config.free_on_abort and state.pages:
            # Source pages are not held either (SGLang #38961): reusable at once.
            self.free_pages(state.pages, state.room)

    def _remember_rejection(self, room: int, message: str) -> None:
        self.rejected[room] = message
        while len(self.rejected) > _REJECTED_MEMORY:
            self.rejected.popitem(last=False)
        waiter = self._room_waiters.pop(room, None)
        if waiter is not None:
            waiter.set()

    # -- the transfer -----------------------------------------------------------------------

    async def _transfer(self, state: PrefillRoom) -> None:
        assert state.result is not None
        pages = state.pages
        outcome = "aborted"
        try:
            outcome = await self._run_transfer(state, pages)
        except Exception as exc:  # a sim bug or a dead peer must not hang the request
            state.error = f"KV transfer error: {type(exc).__name__}"
            outcome = "failed"
        finally:
            self._give_back(state)
            if pages:
                self.free_pages(pages, state.room)
            self.rooms.pop(state.room, None)
            if not state.result.done():
                state.result.set_result(outcome)

    async def _run_transfer(self, state: PrefillRoom, pages: list[int]) -> str:
        self.waiting_bootstrap += 1
        try:
            dest_task: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(state.dest))
            abort_task: asyncio.Future[Any] = asyncio.ensure_future(state.aborted.wait())
            await asyncio.wait(
                {dest_task, abort_task},
                timeout=self.config.bootstrap_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in (dest_task, abort_task):
                task.cancel()
        finally:
            self.waiting_bootstrap -= 1
        if not state.dest.done():
            if not state.aborted.is_set():
                self.stats.bootstrap_failures += 1
                state.error = "Timed out waiting for the decode server to bootstrap."
                return "failed"
            return "aborted"
        decode_url, dest_pages = state.dest.result()
        state.decode_url = decode_url
        n_pages = self.pool.pages_for(len(state.compute_ids))
        pages.extend(await self.alloc_pages(n_pages, state.room))
        ps = self.pool.page_size
        for i, page in enumerate(pages):
            self.pool.write_local(page, state.compute_ids[i * ps : (i + 1) * ps], state.room)
        compute_s = len(state.compute_ids) * self.faults.prefill_us_per_token / 1e6
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.aborted.wait(), timeout=compute_s)
        if state.aborted.is_set():
            await self._send(decode_url, "ack", {"room": state.room})
            return "aborted"
        if len(dest_pages) < n_pages:
            state.error = "Decode reserved fewer pages than the prompt needs."
            return "failed"
        return await self._send_pages(state, decode_url, pages, dest_pages[:n_pages])

    async def _send_pages(
        self, state: PrefillRoom, decode_url: str, src: list[int], dest: list[int]
    ) -> str:
        n_tokens = len(state.compute_ids)
        ps = self.pool.page_size
        writes = [
            [dest[i], self.pool.read_page(src[i], min(ps, n_tokens - i * ps))]
            for i in range(len(src))
        ]
        batch = self.faults.transfer_batch_pages or len(writes)
        fail = self.rng.random() < self.faults.transfer_failure_probability
        self.stats.transfers_started += 1
        self.inflight_transfers += 1
        try:
            for start in range(0, len(writes), batch):
                if state.aborted.is_set():
                    break
                issued = self.spawn(
                    self._send(
                        decode_url,
                        "write",
                        {
                            "room": state.room,
                            "ms_per_page": self.faults.transfer_ms_per_page,
                            "writes": writes[start : start + batch],
                        },
                    )
                )
                state.inflight.add(issued)
                issued.add_done_callback(state.inflight.discard)
                if fail:
                    return await self._report_failure(state, decode_url, issued, writes)
                # Waiting for the batch's completion is not interruptible: it is on the wire.
                await asyncio.shield(issued)
        finally:
            self.inflight_transfers -= 1
        if state.aborted.is_set():
            await self._send(decode_url, "ack", {"room": state.room})
            return "aborted"
        self.stats.transfers_completed += 1
        self._give_back(state)
        await self._send(decode_url, "done", self._done_ok(state, writes))
        return "ok"

    def _done_ok(self, state: PrefillRoom, writes: list[list[Any]]) -> dict[str, Any]:
        """The final "done"; with the KV checksum on it carries the digest of what was sent."""
        done: dict[str, Any] = {"room": state.room, "status": "ok"}
        if self.config.kv_checksum:
            done["kv_checksum"] = kv_digest(t for _, tokens in writes for t in tokens)
            done["kv_tokens"] = sum(len(tokens) for _, tokens in writes)
        return done

    async def _report_failure(
        self,
        state: PrefillRoom,
        decode_url: str,
        issued: asyncio.Task[Any],
        writes: list[list[Any]],
    ) -> str:
        self._give_back(state)
        self.stats.transfer_failures += 1
        if self.config.failed_send_as_drained:
            # The bug: the failure is reported as a drained, finished transfer.
            await self._send(decode_url, "done", self._done_ok(state, writes))
            return "ok"
        state.error = (
            f"KV transfer failed for bootstrap_room={state.room}: injected transfer failure"
        )
        await self._send(
            decode_url, "done", {"room": state.room, "status": "failed", "error": state.error}
        )
        await asyncio.shield(issued)
        await self._send(decode_url, "ack", {"room": state.room})
        return "failed"

    async def _send(self, decode_url: str, kind: str, payload: dict[str, Any]) -> Any:
        try:
            async with self.session.post(f"{decode_url}/sim/kv/{kind}", json=payload) as resp:
                return await resp.json()
        except (aiohttp.ClientError, json.JSONDecodeError, OSError):
            return None

    # -- the bootstrap side (decode calls these) ---------------------------------------------

    async def _handshake(self, request: web.Request) -> web.Response:
        room = int((await request.json())["room"])
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        while room not in self.rooms and room not in self.rejected:
            left = deadline - time.monotonic()
            if left <= 0:
                return web.json_response({"status": "timeout"}, status=504)
            waiter = self._room_waiters.setdefault(room, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), timeout=left)
            except TimeoutError:
                self._room_waiters.pop(room, None)
        if room in self.rejected:
            return web.json_response(
                {"status": "rejected", "message": self.rejected[room], "code": 400}
            )
        return web.json_response({"status": "ok", "tokens": len(self.rooms[room].compute_ids)})

    async def _dest(self, request: web.Request) -> web.Response:
        body = await request.json()
        state = self.rooms.get(int(body["room"]))
        if state is None:
            return web.json_response({"status": "unknown room"}, status=404)
        if not state.dest.done():
            state.dest.set_result((str(body["decode_url"]), [int(p) for p in body["pages"]]))
        return web.json_response({"status": "ok"})

    async def _abort_room(self, request: web.Request) -> web.Response:
        """Decode asks to stop; ack now if nothing of this room can still be in flight."""
        room = int((await request.json())["room"])
        state = self.rooms.get(room)
        if state is None:
            return web.json_response({"ack": True})
        self._abort(state)
        # Nothing on the wire: the sender checks the abort before issuing the next batch.
        return web.json_response({"ack": not state.inflight})
