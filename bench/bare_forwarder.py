"""What aiohttp + uvloop alone cost: a ~50-line forwarder with no policy at all.

Run: `python bench/bare_forwarder.py --port P --upstream http://127.0.0.1:U`. It reads the
body, forwards method, path, headers and bytes, and relays the response as it arrives.
It is the yardstick kvproxy's policy overhead is divided by; keep it as lean as a careful
author would write it, and never add policy here.
"""

from __future__ import annotations

import argparse

import aiohttp
import uvloop
from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "upgrade"}
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    session = request.app[SESSION]
    async with session.request(
        request.method, request.app[UPSTREAM] + request.path_qs, headers=headers, data=body
    ) as up:
        resp = web.StreamResponse(status=up.status)
        for k, v in up.headers.items():
            if k.lower() not in HOP:
                resp.headers[k] = v
        await resp.prepare(request)
        async for data in up.content.iter_any():
            await resp.write(data)
        await resp.write_eof()
        return resp


async def make_app(upstream: str, max_connections: int = 1024) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[UPSTREAM] = upstream.rstrip("/")

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=max_connections)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as s:
            app[SESSION] = s
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    # Upstream connections at once (aiohttp's connector limit); the streams-at-scale phase
    # raises it above its largest step, as it raises kvproxy's upstream_max_connections.
    parser.add_argument("--max-connections", type=int, default=1024)
    args = parser.parse_args()
    app = make_app(args.upstream, args.max_connections)
    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
