"""A TEST prefill/decode router for the real vLLM pair (tests/real/engines.py starts it).

Not a product and not kvproxy: the smallest router that follows vLLM's documented
disaggregated-serving protocol (docs "Disaggregated Prefilling", the NixlConnector's
kv_transfer_params), as vLLM's own example proxy does. smg 1.13 cannot stand here: with
``--backend vllm`` it does not hand ``kv_transfer_params`` on (test_real_smg.py shows it).

One request, two legs:

1. prefill: the client's body with ``max_tokens: 1``, no streaming, and
   ``kv_transfer_params: {"do_remote_decode": true}``. The prefill engine computes the prompt's
   KV, keeps the blocks for the decode side and answers with the ``kv_transfer_params`` decode
   needs (engine id, block ids, side-channel host and port). An error (e.g. a prompt over
   prefill's --max-model-len) goes back to the client as the engine wrote it.
2. decode: the client's body plus those ``kv_transfer_params``; decode pulls the blocks over NIXL
   (its ``prompt_tokens_by_source{source="external_kv_transfer"}``) and its answer is streamed
   back as it comes.

A client that goes away cancels the handler (aiohttp ``handler_cancellation``), which closes
whichever upstream connection is open: vLLM aborts that request. Logs say which leg ran, never
a prompt.

Test hook: ``POST /test/hold-decode {"seconds": S}`` makes the next request wait S seconds
between its two legs, prefill done and its KV pinned for decode's pull. On a CPU the pull itself
takes ~0.2 ms, too short for a client to leave during it; the hold opens that window (the
transfer phase: the KV exists only on prefill, decode has not read it) so a test can leave
inside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("pd_test_router")

PREFILL_ONLY = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SESSION = web.AppKey("session", aiohttp.ClientSession)
PREFILL = web.AppKey("prefill", str)
DECODE = web.AppKey("decode", str)
HOLDS = web.AppKey("holds", list)  # one-shot holds (seconds) for the next requests' transfer phase


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream_options")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_ONLY)
    return leg


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def models(request: web.Request) -> web.Response:
    async with request.app[SESSION].get(request.app[DECODE] + "/v1/models") as resp:
        return web.Response(
            status=resp.status, body=await resp.read(), content_type="application/json"
        )


async def hold_decode(request: web.Request) -> web.Response:
    seconds = float((await request.json())["seconds"])
    if not 0 < seconds <= 60:
        return web.json_response({"error": {"message": "seconds: 0 < s <= 60"}}, status=400)
    request.app[HOLDS].append(seconds)
    return web.json_response({"held": len(request.app[HOLDS])})


async def generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
    log.info("rid=%s leg=prefill start path=%s", rid, request.path)
    async with app[SESSION].post(
        app[PREFILL] + request.path, json=prefill_body(body), headers=headers
    ) as resp:
        raw = await resp.read()
        if resp.status != 200:
            log.info("rid=%s leg=prefill status=%d (returned to the client)", rid, resp.status)
            return web.Response(status=resp.status, body=raw, content_type="application/json")
    transfer = json.loads(raw).get("kv_transfer_params")
    log.info("rid=%s leg=prefill done kv_transfer_params=%s", rid, "yes" if transfer else "no")
    if app[HOLDS]:
        seconds = app[HOLDS].pop(0)
        log.info("rid=%s transfer phase held %.1f s (test hook)", rid, seconds)
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            log.info("rid=%s client gone in the transfer phase: decode never asked", rid)
            raise
    decode = dict(body)
    if transfer:
        decode["kv_transfer_params"] = transfer
    async with app[SESSION].post(app[DECODE] + request.path, json=decode, headers=headers) as resp:
        out = web.StreamResponse(
            status=resp.status,
            headers={"Content-Type": resp.headers.get("Content-Type", "application/json")},
        )
        await out.prepare(request)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
    log.info("rid=%s leg=decode done status=%d", rid, resp.status)
    return out


async def open_session(app: web.Application) -> None:
    app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))


async def close_session(app: web.Application) -> None:
    await app[SESSION].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="prefill engine base URL")
    parser.add_argument("--decode", required=True, help="decode engine base URL")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    app = web.Application(client_max_size=64 << 20)
    app[PREFILL], app[DECODE] = args.prefill, args.decode
    app[HOLDS] = []
    app.router.add_post("/test/hold-decode", hold_decode)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    web.run_app(app, host="127.0.0.1", port=args.port, handler_cancellation=True, print=None)


if __name__ == "__main__":
    main()
