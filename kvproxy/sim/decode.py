"""The decode engine: page reservation, the receiving NIC, and the echo model.

Owns: the decode half of a PD request. It checks the prompt against its own pool,
handshakes with prefill's bootstrap for the request's ``bootstrap_room``, reserves pages
for the prompt's *original* length, hands their indices to prefill, waits for "transfer
done", then generates by reading back, one token per step, what its pages hold.

The NIC (``POST /sim/kv/write``) models one-sided remote writes: a batch lands when it
completes, ``ms_per_page`` per page after it was issued, whoever owns the pages by then.
The decode scheduler cannot stop it; it can only decide when to give the pages away.

The echo model makes a leak visible as text: a correct request replies with its own
prompt, read from its own pages; any slot another request wrote shows up as that
request's text and is counted in ``stale_page_reads``.

The failure mode it owns (``EngineConfig.free_on_abort``): on a client disconnect the
pages are freed at once, while prefill's issued writes are still landing; off: the pages
are held until prefill's ABORT_ACK, or ``abort_ack_timeout_s`` (counted apart).

Independent oracle: never imports kvproxy code outside ``kvproxy/sim``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvproxy.sim.checksum import landed_digest
from kvproxy.sim.engine import EngineServer
from kvproxy.sim.limits import (
    EngineError,
    clamp_new_tokens,
    native_error_body,
    pool_refusal,
    stream_error_event,
)
from kvproxy.sim.pool import NO_WRITER
from kvproxy.sim.protocol import ROUTE_GENERATE, SSE_DONE, GenRequest, StreamShaper, full_reply, sse


@dataclass
class DecodeRoom:
    room: int
    prefill_url: str
    pages: list[int] = field(default_factory=list)
    done: asyncio.Future[dict[str, Any]] | None = None
    ack: asyncio.Event = field(default_factory=asyncio.Event)
    drained: bool = False  # "transfer done" arrived: nothing more will be written
    deferred: bool = False  # a deferred release owns the pages now


class DecodeServer(EngineServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, DecodeRoom] = {}
        self._rooms_seen: set[int] = set()
        self.inflight_transfers = 0

    def add_routes(self, app: web.Application) -> None:
        super().add_routes(app)
        app.router.add_post("/sim/kv/write", self._nic_write)
        app.router.add_post("/sim/kv/done", self._kv_done)
        app.router.add_post("/sim/kv/ack", self._kv_ack)

    # -- the generation request -------------------------------------------------------------

    async def serve(self, request: web.Request, req: GenRequest) -> web.StreamResponse:
        assert req.bootstrap_room is not None
        assert req.bootstrap_host is not None
        port = req.bootstrap_port or self.config.default_bootstrap_port
        state = DecodeRoom(
            room=req.bootstrap_room, prefill_url=f"http://{req.bootstrap_host}:{port}"
        )
        n = len(req.input_ids)
        refusal = pool_refusal(self.limits, n, self.config.flavor)
        if refusal is not None:
            self.stats.rejections_at_admission += 1
            self.spawn(self._tell_prefill_abort(state))
            return await self.refuse(request, req, EngineError(refusal))
        resp: web.StreamResponse | None = None
        try:
            if req.stream:
                resp = await self.open_stream(request)
            failure = await self._bootstrap(state, n)
            if failure is None:
                failure = await self._wait_transfer(state)
            if failure is not None:
                return await self._fail(request, req, resp, failure)
            return await self._echo(request, req, resp, state)
        except (asyncio.CancelledError, ConnectionError):
            self._on_abort(state)
            raise
        finally:
            if not state.deferred:
                self.rooms.pop(state.room, None)

    async def _bootstrap(self, state: DecodeRoom, n_tokens: int) -> EngineError | None:
        try:
            async with self.session.post(
                f"{state.prefill_url}/sim/kv/handshake", json={"room": state.room}
            ) as resp:
                answer = await resp.json()
        except (aiohttp.ClientError, json.JSONDecodeError, OSError):
            answer = {"status": "unreachable"}
        if answer.get("status") == "rejected":
            # The original refusal travels with the handshake, as the fixed engine keeps it.
            return EngineError(str(answer.get("message")), int(answer.get("code", 400)))
        if answer.get("status") != "ok":
            self.stats.bootstrap_failures += 1
            return EngineError(
                f"KV bootstrap with the prefill server failed (bootstrap_room={state.room}).", 500
            )
        state.done = asyncio.get_running_loop().create_future()
        self.rooms[state.room] = state
        # Decode reserves for the prompt it was sent, whatever prefill decided to compute.
        state.pages = await self.alloc_pages(self.pool.pages_for(n_tokens), state.room)
        try:
            async with self.session.post(
                f"{state.prefill_url}/sim/kv/dest",
                json={
                    "room": state.room,
                    "decode_url": self.url,
                    "pages": state.pages,
                },
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, OSError):
            ok = False
        if not ok:
            self.stats.bootstrap_failures += 1
            self.free_pages(state.pages, state.room)
            return EngineError(
                f"KV bootstrap with the prefill server failed (bootstrap_room={state.room}).", 500
            )
        return None

    async def _wait_transfer(self, state: DecodeRoom) -> EngineError | None:
        assert state.done is not None
        self.inflight_transfers += 1
        try:
            message = await asyncio.wait_for(
                asyncio.shield(state.done), self.faults.waiting_timeout_s
            )
        except TimeoutError:
            self.stats.waiting_timeouts += 1
            message = {"status": "failed", "error": "KV transfer waiting timed out."}
        finally:
            self.inflight_transfers -= 1
        mismatch = message.get("status") == "ok" and self._checksum_mismatch(state, message)
        if message.get("status") == "ok" and not mismatch:
            state.drained = True
            self.stats.transfers_completed += 1
            return None
        self.stats.transfer_failures += 1
        # The fixed engine reports the failure and keeps the pages until prefill's ack; on
        # a checksum mismatch prefill believes it finished, so decode asks it to abort.
        state.deferred = True
        self.spawn(self._release_after_ack(state, ask=mismatch))
        return EngineError(str(message.get("error") or "KV transfer failed."), 500)

    def _checksum_mismatch(self, state: DecodeRoom, message: dict[str, Any]) -> bool:
        """With the checksum on both sides, compare prefill's digest with what landed."""
        digest = message.get("kv_checksum")
        if not self.config.kv_checksum or not isinstance(digest, int):
            return False
        landed = landed_digest(self.pool, state.pages, int(message.get("kv_tokens", 0)))
        if landed == digest:
            return False
        self.stats.checksum_mismatches += 1
        message["error"] = f"KV checksum mismatch for bootstrap_room={state.room}; aborted."
        return True

    async def _fail(
        self,
        request: web.Request,
        req: GenRequest,
        resp: web.StreamResponse | None,
        exc: EngineError,
    ) -> web.StreamResponse:
        if resp is None:
            return await self.refuse(request, req, exc)
        event = (
            native_error_body(exc.message)
            if req.route == ROUTE_GENERATE
            else stream_error_event(self.config.flavor, exc.message, exc.status)
        )
        with contextlib.suppress(ConnectionError):
            await resp.write(sse(event))
            await resp.write(SSE_DONE)
        return resp

    # -- the echo model ---------------------------------------------------------------------

    async def _echo(
        self,
        request: web.Request,
        req: GenRequest,
        resp: web.StreamResponse | None,
        state: DecodeRoom,
    ) -> web.StreamResponse:
        n_prompt = len(req.input_ids)
        allowed = clamp_new_tokens(self.limits, n_prompt, req.max_new_tokens)
        if req.max_new_tokens is not None and allowed < req.max_new_tokens:
            # Ground truth for "the engine silently cut what the client asked for".
            self.stats.outputs_clamped += 1
        length = min(n_prompt, allowed)
        finish = "stop" if length >= n_prompt else "length"
        detok = self.tokenizer.new_detokenizer()
        shaper = StreamShaper(req, n_prompt)
        stale_pages: set[int] = set()
        output: list[int] = []
        texts: list[str] = []
        if resp is not None:
            for chunk in shaper.first():
                await resp.write(sse(chunk))
        loop = asyncio.get_running_loop()
        start = loop.time()
        step_s = self.faults.decode_ms_per_token / 1000
        position = 0
        while position < length:
            # Catch up in one chunk when behind schedule, instead of one write per token.
            due = length
            if step_s > 0:
                due = min(length, max(position + 1, int((loop.time() - start) / step_s) + 1))
            piece: list[str] = []
            for pos in range(position, due):
                token, writer = self.pool.read(state.pages, pos)
                if writer != state.room and pos // self.pool.page_size not in stale_pages:
                    stale_pages.add(pos // self.pool.page_size)
                    self.stats.stale_page_reads += 1
                if writer != NO_WRITER or token >= 0:
                    output.append(token)
                    piece.append(detok.push(token))
            count, position = due - position, due
            if position >= length:
                piece.append(detok.flush())
            text = "".join(piece)
            texts.append(text)
            if resp is not None:
                last = finish if position >= length else None
                await resp.write(sse(shaper.delta(text, count, last)))
            if position < length and step_s > 0:
                await asyncio.sleep(max(0.0, start + position * step_s - loop.time()))
        self.stats.generation_tokens += length
        self.stats.prompt_tokens += n_prompt
        self.stats.requests_finished += 1
        self.free_pages(state.pages, state.room)
        if resp is None:
            return web.json_response(full_reply(req, "".join(texts), n_prompt, output, finish))
        if length == 0:
            await resp.write(sse(shaper.delta("", 0, finish)))
        usage = shaper.usage()
        if usage is not None:
            await resp.write(sse(usage))
        await resp.write(SSE_DONE)
        return resp

    # -- aborts -----------------------------------------------------------------------------

    def _on_abort(self, state: DecodeRoom) -> None:
        self.stats.aborts += 1
        if state.pages and not state.drained:
            self.stats.aborts_before_drain += 1
        if not state.pages or state.drained:
            if state.pages:
                self.free_pages(state.pages, state.room)
            self.spawn(self._tell_prefill_abort(state))
            return
        if self.config.free_on_abort:
            # The race: prefill's issued writes may land in pages handed out next.
            self.free_pages(state.pages, state.room)
            self.spawn(self._tell_prefill_abort(state))
        else:
            state.deferred = True
            self.spawn(self._release_after_ack(state, ask=True))

    async def _tell_prefill_abort(self, state: DecodeRoom) -> None:
        try:
            async with self.session.post(
                f"{state.prefill_url}/sim/kv/abort", json={"room": state.room}
            ) as resp:
                answer = await resp.json()
            if answer.get("ack"):
                state.ack.set()
        except (aiohttp.ClientError, json.JSONDecodeError, OSError):
            pass

    async def _release_after_ack(self, state: DecodeRoom, ask: bool) -> None:
        """Deferred release: keep the pages until prefill says nothing is in flight."""
        try:
            if ask:
                await self._tell_prefill_abort(state)
            try:
                await asyncio.wait_for(state.ack.wait(), timeout=self.faults.abort_ack_timeout_s)
                self.stats.abort_acks += 1
            except TimeoutError:
                # A timeout proves nothing about writes in flight; it is counted apart.
                self.stats.abort_ack_timeouts += 1
        finally:
            self.free_pages(state.pages, state.room)
            if self.rooms.get(state.room) is state:
                del self.rooms[state.room]

    # -- the NIC and the control messages prefill sends ------------------------------------

    async def _nic_write(self, request: web.Request) -> web.Response:
        body = await request.json()
        room = int(body["room"])
        writes = [(int(page), [int(t) for t in tokens]) for page, tokens in body["writes"]]
        if room not in self._rooms_seen:
            self._rooms_seen.add(room)
            self.stats.transfers_started += 1
            if len(self._rooms_seen) > 65536:
                self._rooms_seen.clear()
        for page, _ in writes:
            self.pool.issue_write(page)
        delay_s = len(writes) * float(body.get("ms_per_page", 0)) / 1000
        landing = self.spawn(self._land(room, writes, delay_s))
        await asyncio.shield(landing)
        return web.json_response({"landed": len(writes)})

    async def _land(self, room: int, writes: list[tuple[int, list[int]]], delay_s: float) -> None:
        try:
            await asyncio.sleep(delay_s)
        finally:
            # Land even when the sim is shutting down, so pending counts stay truthful.
            for page, tokens in writes:
                self.pool.land_write(page, tokens, room)

    async def _kv_done(self, request: web.Request) -> web.Response:
        body = await request.json()
        state = self.rooms.get(int(body["room"]))
        if state is not None and state.done is not None and not state.done.done():
            state.done.set_result(body)
        return web.json_response({"status": "ok"})

    async def _kv_ack(self, request: web.Request) -> web.Response:
        state = self.rooms.get(int((await request.json())["room"]))
        if state is not None:
            state.ack.set()
        return web.json_response({"status": "ok"})
