"""What every simulated engine server shares: lifecycle, page queue, admin API.

Owns: ``EngineServer``, the aiohttp app with the admin routes the real engines expose
(``/health``, ``/server_info``, ``/get_server_info``, ``/model_info``, ``/v1/models``,
``/tokenize``, ``/metrics``, ``/abort_request``) plus the sim-only ``/sim/*`` routes, and
the front half of every generation request (read, parse, context check, route count).
The role-specific halves live in ``prefill.py`` and ``decode.py``.

Independent oracle: never imports kvproxy code outside ``kvproxy/sim``; never logs or
exposes prompt or completion text except in the reply to the request that sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web

from kvproxy.sim.converse import ROUTE_MESSAGES, ROUTE_RESPONSES
from kvproxy.sim.limits import (
    EngineError,
    Limits,
    check_context,
    native_error_body,
    openai_error_body,
    reserved_tokens,
    stream_error_event,
)
from kvproxy.sim.metrics_text import render_metrics
from kvproxy.sim.pool import PagedPool
from kvproxy.sim.protocol import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_GENERATE,
    SSE_DONE,
    GenRequest,
    parse_request,
    sse,
)
from kvproxy.sim.state import SIM_VERSION, VLLM_SIM_VERSION, EngineConfig, EngineStats, Faults
from kvproxy.sim.tokenizer import ChatRenderer, load_tokenizer


class _GrpcProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for HTTP/2 prefaces (the router's gRPC probes), only."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


_GRPC_FILTER = _GrpcProbeFilter()


class EngineServer:
    """One prefill or decode engine: an aiohttp app bound to ``config.port``."""

    def __init__(self, config: EngineConfig, faults: Faults | None = None) -> None:
        self.config = config
        self.faults = faults or Faults()
        # One rank's pool (see PagedPool on rounding); DCP ranks together (SGLang) or DP
        # engines together (vLLM) hold `scale` of them, which is what the sim allocates from.
        self.rank_pool_tokens = config.pool_tokens
        scale = config.dcp_size if config.flavor == "sglang" else config.dp_size
        self.pool = PagedPool(self.rank_pool_tokens * scale, config.page_size)
        self.limits = Limits(
            config.context_length,
            self.rank_pool_tokens,
            reserved_tokens=reserved_tokens(config),
            dcp_size=config.dcp_size if config.flavor == "sglang" else 1,
            page_size=config.page_size,
        )
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.renderer = ChatRenderer(self.tokenizer.chat_template, self.tokenizer.special_tokens)
        self.stats = EngineStats()
        self.rng = random.Random(config.seed)
        self.running: dict[str, asyncio.Task[Any]] = {}
        self.queued = 0
        self._background: set[asyncio.Task[Any]] = set()
        self._pool_changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = config.port
        self.started_at = time.time()
        if config.flavor == "vllm" and config.context_length > self.rank_pool_tokens:
            # vLLM refuses to start when max_model_len does not fit its own KV cache.
            raise ValueError(
                f"The model's max seq len ({config.context_length}) is larger than the "
                "maximum number of tokens that can be stored in KV cache "
                f"({self.rank_pool_tokens}). Try increasing `gpu_memory_utilization` or "
                "decreasing `max_model_len` when initializing the engine."
            )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "server not started"
        return self._session

    async def start(self) -> None:
        logging.getLogger("aiohttp.server").addFilter(_GRPC_FILTER)  # idempotent
        app = web.Application(client_max_size=64 * 1024 * 1024)
        self.add_routes(app)
        # Cancel handlers when the peer leaves: that is how a disconnect reaches the engine.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.port = int(server.sockets[0].getsockname()[1])
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run work that must outlive the HTTP request that started it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def pool_changed(self) -> None:
        self._pool_changed.set()

    async def alloc_pages(self, num_pages: int, owner: int) -> list[int]:
        """Allocate, waiting (bounded) for pages to be released: the engine's queue."""
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        self.queued += 1
        try:
            while True:
                if num_pages <= self.pool.free_pages:
                    return self.pool.alloc(num_pages, owner)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError("Timed out waiting for KV cache pages.", 503)
                self._pool_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pool_changed.wait(), timeout=min(left, 0.5))
        finally:
            self.queued -= 1

    def free_pages(self, pages: list[int], owner: int) -> None:
        self.pool.free(pages, owner)
        self.pool_changed()

    # -- routes ---------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        r.add_get("/v1/models", self._models)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/v1/tokenize", self._tokenize)
        r.add_get("/metrics", self._metrics)
        r.add_get("/sim/stats", self._sim_stats)
        r.add_get("/sim/faults", self._sim_faults)
        r.add_post("/sim/faults", self._sim_faults)
        r.add_post("/sim/reset", self._sim_reset)
        r.add_post(ROUTE_CHAT, self._generate)
        r.add_post(ROUTE_COMPLETIONS, self._generate)
        r.add_post(ROUTE_RESPONSES, self._generate)
        r.add_post(ROUTE_MESSAGES, self._generate)
        if self.config.flavor == "sglang":
            r.add_get("/server_info", self._server_info)
            r.add_get("/get_server_info", self._server_info)
            r.add_get("/model_info", self._model_info)
            r.add_get("/get_model_info", self._model_info)
            r.add_post(ROUTE_GENERATE, self._generate)
            r.add_post("/abort_request", self._abort_request)
            r.add_post("/flush_cache", self._health)
        else:
            r.add_get("/version", self._version)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_SIM_VERSION})

    def server_info(self) -> dict[str, Any]:
        c = self.config
        args: dict[str, Any] = {
            "model_path": c.model_name,
            "tokenizer_path": c.tokenizer or c.model_name,
            "served_model_name": c.model_name,
            "host": c.host,
            "port": self.port,
            "context_length": c.context_length,
            "page_size": c.page_size,
            "max_total_tokens": None,
            "chunked_prefill_size": 8192,
            "max_running_requests": None,
            "tp_size": c.dcp_size,
            "dp_size": 1,
            "dcp_size": c.dcp_size,
            "speculative_algorithm": c.speculative_algorithm,
            "speculative_num_steps": c.speculative_num_steps,
            "speculative_eagle_topk": c.speculative_eagle_topk,
            "speculative_num_draft_tokens": c.speculative_num_draft_tokens,
            "allow_auto_truncate": c.allow_auto_truncate,
            "disaggregation_mode": c.role,
            "disaggregation_transfer_backend": c.transfer_backend,
            "disaggregation_enable_kv_checksum": c.kv_checksum,
            "disaggregation_bootstrap_port": self.port,
            "num_reserved_decode_tokens": 512,
            "enable_metrics": True,
            "random_seed": c.seed,
        }
        state = {
            **args,
            "last_gen_throughput": 0.0,
            "memory_usage": {
                "weight": 0.0,
                "kvcache": 0.0,
                "token_capacity": self.rank_pool_tokens,
                "graph": 0,
            },
            "effective_max_running_requests_per_dp": 128,
        }
        return {
            **args,
            "status": "ready",
            "max_total_num_tokens": self.rank_pool_tokens,
            "max_req_input_len": self.limits.max_req_input_len,
            "internal_states": [state],
            "version": c.version or SIM_VERSION,
        }

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info())

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.config.model_name,
                "tokenizer_path": self.config.tokenizer or self.config.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "sim-echo",
                "architectures": ["SimEchoForCausalLM"],
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        owner = "vllm" if self.config.flavor == "vllm" else "sglang"
        name = self.config.model_name
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(self.started_at),
                        "owned_by": owner,
                        "root": name,
                        "parent": None,
                        "max_model_len": self.config.context_length,
                    }
                ],
            }
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error_json(request.path, "Invalid JSON body.", 400)
        if not isinstance(body, dict):
            return self._error_json(request.path, "The request body must be an object.", 400)
        limit = self.config.context_length
        if self.config.flavor == "vllm" and "messages" in body:
            try:
                ids = parse_request(
                    ROUTE_CHAT,
                    {"messages": body["messages"], "tools": body.get("tools")},
                    self.tokenizer,
                    self.renderer,
                    self.config.model_name,
                ).input_ids
            except EngineError as exc:
                return self._error_json(request.path, exc.message, exc.status)
            return web.json_response(
                {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}
            )
        prompt = body.get("prompt")
        special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
            out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": limit}
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            many = [self.tokenizer.encode(p, add_special_tokens=special) for p in prompt]
            out = {"tokens": many, "count": [len(t) for t in many], "max_model_len": limit}
        else:
            # FastAPI's validation error: what SGLang answers for a body without "prompt".
            return web.json_response(
                {
                    "detail": [
                        {
                            "type": "missing",
                            "loc": ["body", "prompt"],
                            "msg": "Field required",
                            "input": None,
                        }
                    ]
                },
                status=422,
            )
        if self.config.flavor == "vllm":
            out["token_strs"] = None
        return web.json_response(out)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = render_metrics(self)
        return web.Response(body=body, headers={"Content-Type": content_type})

    def stats_json(self) -> dict[str, Any]:
        data = asdict(self.stats)
        data["requests_by_route"] = dict(self.stats.requests_by_route)
        data.update(asdict(self.pool.counters))
        c = self.config
        data.update(
            role=c.role,
            flavor=c.flavor,
            port=self.port,
            switches={
                "pending_rejection_transfers": c.pending_rejection_transfers,
                "free_on_abort": c.free_on_abort,
                "failed_send_as_drained": c.failed_send_as_drained,
            },
            pool={
                "pool_tokens": self.pool.total_tokens,
                # One rank's (SGLang DCP) or one engine's (vLLM DP) share of pool_tokens.
                "rank_pool_tokens": self.rank_pool_tokens,
                "page_size": self.pool.page_size,
                "num_pages": self.pool.num_pages,
                "free_pages": self.pool.free_pages,
            },
            # The engine's own arithmetic, for tests that judge kvproxy against it.
            limits={
                "context_len": self.limits.context_len,
                "reserved_tokens": self.limits.reserved_tokens,
                "dcp_size": self.limits.dcp_size,
                "max_req_len": self.limits.max_req_len,
                "max_req_input_len": self.limits.max_req_input_len,
                "largest_prompt": (
                    self.limits.largest_prompt if c.flavor == "sglang" else c.context_length - 1
                ),
            },
            running=len(self.running),
            # Writes not landed yet, and work outliving its request (transfers, sends,
            # landings, deferred releases): a test waits for them instead of sleeping.
            writes_in_flight=sum(self.pool.pending_writes),
            background_tasks=len(self._background),
            faults=asdict(self.faults),
        )
        return data

    async def _sim_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_json())

    async def _sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                changes = await request.json()
                if not isinstance(changes, dict):
                    raise EngineError("faults must be a JSON object")
                self.faults.update(changes)
            except (json.JSONDecodeError, EngineError) as exc:
                return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(asdict(self.faults))

    async def _sim_reset(self, request: web.Request) -> web.Response:
        self.stats = EngineStats()
        self.pool.reset_counters()
        return web.json_response({"reset": True})

    async def _abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            body = {}
        abort_all = bool(body.get("abort_all")) if isinstance(body, dict) else False
        rid = body.get("rid") if isinstance(body, dict) else None
        for key, task in list(self.running.items()):
            if abort_all or key == rid:
                task.cancel()
        return web.Response(status=200)

    # -- generation -----------------------------------------------------------------------

    def _error_json(self, route: str, message: str, status: int) -> web.Response:
        if route == ROUTE_GENERATE:
            return web.json_response(native_error_body(message), status=status)
        return web.json_response(
            openai_error_body(self.config.flavor, message, status), status=status
        )

    async def refuse(
        self, request: web.Request, req: GenRequest | None, exc: EngineError
    ) -> web.StreamResponse:
        """Answer a refusal the way the engine does: JSON error, or 200 + error event."""
        if req is None or not req.stream or self.config.flavor == "vllm":
            return self._error_json(request.path, exc.message, exc.status)
        resp = await self.open_stream(request)
        if req.route == ROUTE_GENERATE:
            event = native_error_body(exc.message)
        else:
            event = stream_error_event(self.config.flavor, exc.message, exc.status)
        with contextlib.suppress(ConnectionError):
            await resp.write(sse(event))
            await resp.write(SSE_DONE)
        return resp

    async def open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests_by_route[request.path] += 1
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error_json(request.path, "Invalid JSON in the request body.", 400)
        except ConnectionError:
            return web.Response(status=499)
        try:
            req = parse_request(
                request.path,
                body,
                self.tokenizer,
                self.renderer,
                self.config.model_name,
                request.headers.get("X-Request-ID"),
            )
        except EngineError as exc:
            return self._error_json(request.path, exc.message, exc.status)
        if self.config.allow_auto_truncate:
            req.input_ids = req.input_ids[: self.limits.max_req_input_len - 1]
        try:
            check_context(self.config.flavor, self.limits, len(req.input_ids), req.max_new_tokens)
        except EngineError as exc:
            self.stats.rejections_at_admission += 1
            return await self.refuse(request, req, exc)
        if not req.has_bootstrap:
            return self._error_json(
                request.path,
                f"This {self.config.role} server runs in PD disaggregation mode: the request "
                "needs bootstrap_host, bootstrap_port and bootstrap_room (send it through "
                "the PD router).",
                400,
            )
        task = asyncio.current_task()
        assert task is not None
        self.running[req.rid] = task
        try:
            return await self.serve(request, req)
        finally:
            self.running.pop(req.rid, None)

    async def serve(self, request: web.Request, req: GenRequest) -> web.StreamResponse:
        raise NotImplementedError
