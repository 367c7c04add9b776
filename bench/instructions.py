"""Instructions per small chat request, kvproxy against the bare forwarder, under callgrind.

Why: CPU time per request on these shared machines moves by 15 % between rounds of the same
run, and by more between runs (the comparison's own noise line says so), so a 5 % change
cannot be seen in it. The number of instructions a process executes for the same requests
is the same from run to run to within about 1 %: it is what this phase reports, as a ratio
in one run. It is not time (a cache miss costs no instruction), so it complements the CPU
figures above and never replaces them.

How: one Python process per target runs, on one event loop, the client (32 keep-alive
connections, the small chat POST of `payloads`), an upstream answering the fixed chat
completion, and the target (kvproxy from `kvproxy.serve` with the comparison's full policy,
or `bare_forwarder`'s app) in-process. It runs under `valgrind --tool=callgrind` with
instrumentation off until the warm-up is done, then on for exactly N requests
(`callgrind_control -i on/off` from the process itself). "direct" (client to upstream) is
subtracted from each: what is left is the target's own instructions per request. kvproxy
is measured twice: with the comparison's full policy, and with default settings.

Run alone: `python bench/instructions.py --engine URL --tokenizer hf:DIR` (the engine: a
simulated prefill's URL; bench/run.py starts one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REQUESTS = 640
WARMUP = 320
CONNECTIONS = 32
# kvproxy: the comparison's full policy (the Qwen-3 tokenizer and template, a trusted tenant
# header, canaries). kvproxy-defaults: only what a deployment must set (upstream, engines):
# the tokenizer is `auto` (the engine's /tokenize, no template), the tenant comes from the
# bearer token, no canaries. The two take different paths through counting and tenancy.
TARGETS = ("direct", "bare", "kvproxy", "kvproxy-defaults")
KVPROXY_TARGETS = ("kvproxy", "kvproxy-defaults")


# --- the measured process (runs under valgrind) --------------------------------------------


def _child(target: str, engine: str, tokenizer: str, requests: int) -> None:
    import uvloop

    sys.path.insert(0, str(BENCH))
    sys.path.insert(0, str(BENCH.parent))
    from payloads import CHAT_RESPONSE, small_chat_body

    reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(CHAT_RESPONSE)
    ) + CHAT_RESPONSE

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head = self.buf[:end].lower()
                at = head.find(b"content-length:")
                size = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
                if len(self.buf) < end + 4 + size:
                    return
                self.buf = self.buf[end + 4 + size :]
                self.t.write(reply)  # type: ignore[attr-defined]

    def request(port: int, tenant: bytes) -> bytes:
        body = small_chat_body()
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
            b"X-Tenant-ID: %s\r\nContent-Length: %d\r\n\r\n" % (port, tenant, len(body))
        ) + body

    async def client(port: int, n: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        reqs = [request(port, b"acme"), request(port, b"globex")]
        for k in range(n):
            w.write(reqs[k & 1])
            head = await r.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"{target}: {head[:60]!r}")
            low = head.lower()
            at = low.find(b"content-length:")
            if at < 0:  # the bare forwarder streams: chunked
                await r.readuntil(b"\r\n0\r\n\r\n")
                continue
            await r.readexactly(int(low[at + 15 :].split(b"\r\n", 1)[0]))
        w.close()

    async def load(port: int, n: int) -> None:
        await asyncio.gather(*(client(port, n // CONNECTIONS) for _ in range(CONNECTIONS)))

    async def callgrind(switch: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            "callgrind_control", "-i", switch, str(os.getpid()), stdout=subprocess.DEVNULL
        )
        await proc.wait()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        up = await loop.create_server(Upstream, "127.0.0.1", 0)
        up_port = up.sockets[0].getsockname()[1]
        stop: Any = None
        port = up_port
        if target in KVPROXY_TARGETS:
            import targets

            os.environ.update(
                {
                    "KVPROXY_LISTEN": "127.0.0.1:0",
                    "KVPROXY_ADMIN_LISTEN": "127.0.0.1:0",
                    "KVPROXY_UPSTREAM": f"http://127.0.0.1:{up_port}",
                    "KVPROXY_ENGINES": json.dumps(
                        [{"url": engine, "role": "prefill", "kind": "sglang"}]
                    ),
                }
            )
            if target == "kvproxy":
                os.environ.update(
                    {
                        "KVPROXY_TOKENIZER": tokenizer,
                        "KVPROXY_TRUST_TENANT_HEADER": "true",
                        "KVPROXY_ACCESS_LOG": "true",
                        "KVPROXY_CANARIES": json.dumps(targets.CANARIES),
                    }
                )
            from kvproxy.config import Settings
            from kvproxy.observe import setup_logging
            from kvproxy.serve import KvproxyServer

            setup_logging("info")  # the access line goes to stderr, discarded by the parent
            server = KvproxyServer(Settings())
            await server.start()
            for _ in range(100):
                if server.services.models.ready():
                    break
                await asyncio.sleep(0.1)
            port, stop = server.public_port, server.stop
        elif target == "bare":
            import bare_forwarder
            from aiohttp import web

            runner = web.AppRunner(
                await bare_forwarder.make_app(f"http://127.0.0.1:{up_port}"), access_log=None
            )
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port, stop = site._server.sockets[0].getsockname()[1], runner.cleanup  # type: ignore[union-attr]
        await load(port, WARMUP)
        await callgrind("on")
        await load(port, requests)
        await callgrind("off")
        if stop is not None:
            await stop()

    uvloop.run(main())


# --- the parent: one valgrind run per target ----------------------------------------------


def _collected(target: str, engine: str, tokenizer: str, requests: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        child = [sys.executable, __file__, "--child", target, "--engine", engine]
        child += ["--tokenizer", tokenizer, "--requests", str(requests)]
        proc = subprocess.run(
            [*valgrind, f"--callgrind-out-file={out}", *child],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=900,
            check=False,
        )
        found = re.search(r"Collected : (\d+)", proc.stderr)
        if proc.returncode != 0 or found is None:
            tail = proc.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"{target} under callgrind: rc {proc.returncode}: {tail}")
        return int(found.group(1))


def available() -> str | None:
    """None when valgrind and callgrind_control are installed, else why not."""
    for tool in ("valgrind", "callgrind_control"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"{tool} is missing (make sysdeps installs valgrind)"
    return None


def measure(engine: str, tokenizer: str, requests: int = REQUESTS) -> dict[str, Any]:
    """Instructions per request of each target, less the direct path's; and the ratio."""
    total = {t: _collected(t, engine, tokenizer, requests) for t in TARGETS}
    per = {t: (total[t] - total["direct"]) / requests for t in TARGETS[1:]}
    bare = per["bare"]
    return {
        "requests": requests,
        "direct_per_req": round(total["direct"] / requests),
        "bare_per_req": round(bare),
        "kvproxy_per_req": round(per["kvproxy"]),
        "ratio": per["kvproxy"] / bare if bare > 0 else None,
        "defaults_per_req": round(per["kvproxy-defaults"]),
        "ratio_defaults": per["kvproxy-defaults"] / bare if bare > 0 else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--child", choices=TARGETS)
    p.add_argument("--engine", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--requests", type=int, default=REQUESTS)
    args = p.parse_args()
    if args.child:
        _child(args.child, args.engine, args.tokenizer, args.requests)
        return 0
    print(json.dumps(measure(args.engine, args.tokenizer, args.requests), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
