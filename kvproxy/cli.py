"""`kvproxy serve | demo | sim | check | canary`.

Exit codes: 0 success, 1 a check/canary failed, 2 bad configuration or usage (one line on
stderr naming the setting), or an optional package the command needs is not installed (one
line naming the extra).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from kvproxy import __version__
from kvproxy.config import ConfigError, Settings, effective_tokenizer, load_settings
from kvproxy.observe import redact, setup_logging


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (also KVPROXY_CONFIG)")
    p.add_argument("--listen", help="public HOST:PORT (KVPROXY_LISTEN, default 0.0.0.0:8080)")
    p.add_argument("--admin-listen", help="admin HOST:PORT (KVPROXY_ADMIN_LISTEN, default :9090)")
    p.add_argument("--upstream", help="router URL (KVPROXY_UPSTREAM)")
    p.add_argument("--engines", help="JSON list of engines (KVPROXY_ENGINES)")
    p.add_argument("--max-context", type=int, help="declared context (KVPROXY_MAX_CONTEXT)")
    p.add_argument("--tokenizer", help="bytes | engine | hf:PATH | tiktoken:PATH")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    """The command's settings: its flags over the environment over `--config`'s file."""
    overrides: dict[str, Any] = {
        "listen": getattr(args, "listen", None),
        "admin_listen": getattr(args, "admin_listen", None),
        "upstream": getattr(args, "upstream", None),
        "max_context": getattr(args, "max_context", None),
        "tokenizer": getattr(args, "tokenizer", None),
        "log_level": getattr(args, "log_level", None),
    }
    engines = getattr(args, "engines", None)
    if engines:
        try:
            overrides["engines"] = orjson.loads(engines)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"invalid setting engines (--engines): not JSON: {exc}") from None
    overrides.update(extra)
    return load_settings(config_path=getattr(args, "config", None), overrides=overrides)


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a hard dependency on Linux
        return asyncio.run(main())


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings_from(args)
    setup_logging(settings.log_level)

    async def main() -> int:
        from kvproxy.serve import KvproxyServer

        server = KvproxyServer(settings)
        await server.start()
        try:
            await _until_signalled()
        finally:
            await server.stop()
        return 0

    return _run(main)


def demo_settings(args: argparse.Namespace, opts: Any, sim: Any) -> Settings:
    """The demo's kvproxy, configured the way its own checks ask for, so `kvproxy canary`
    and `kvproxy check` pass through it in front of the vulnerable engines:

    - tokenizer: the default (`auto`), i.e. the engines' own /tokenize: exact counts, so
      the published limit is reachable (the byte bound refuses legal prompts near it);
    - max_context: the context the prefill engine actually holds, min(context, prefill
      pool), not the 8,192 the engines advertise: the incident's gap stays visible on the
      engines (straight to the simulator), while the declared value is the one the release
      gate accepts;
    - the tripwire armed for the isolation harness's synthetic tenants, with the settings
      the harness prints (kvproxy.tools.isolation.diagnosis): the demo trusts X-Tenant-ID, which
      is only right behind a gateway that sets it itself.
    """
    from kvproxy.tools import DEFAULT_TENANT_HEADER, DEFAULT_TENANTS, arming_settings

    return _settings_from(
        args,
        upstream=sim.router_url,
        engines=[
            {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
            {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
        ],
        max_context=min(opts.context_length, opts.prefill_pool_tokens),
        **arming_settings(DEFAULT_TENANTS, DEFAULT_TENANT_HEADER),
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from kvproxy.sim import SimCluster, SimOptions

    opts = SimOptions(host="127.0.0.1", port=args.sim_port, mode=args.mode)

    async def main() -> int:
        from kvproxy.serve import KvproxyServer

        sim = SimCluster(opts)
        await sim.start()
        try:
            settings = demo_settings(args, opts, sim)
        except BaseException:
            await sim.close()
            raise
        setup_logging(settings.log_level)
        server = KvproxyServer(settings)
        try:
            await server.start()
            await server.services.models.first.capacity.refresh_now()
            await _seed_tenant_a(sim.router_url)
            print(
                _demo_banner(
                    server.public_url, server.admin_url, sim.router_url, settings, opts.mode
                ),
                flush=True,
            )
            await _until_signalled()
        finally:
            await server.stop()
            await sim.close()
        return 0

    return _run(main)


DEMO_CANARY = "KVCANARY-tenant-a-0123456789abcdef"


async def _seed_tenant_a(sim_url: str) -> None:
    """Put tenant A's synthetic private text into the simulator's KV pages, so the leak the
    banner shows is visibly someone else's data."""
    import aiohttp

    text = f"Tenant A private notes {DEMO_CANARY}. " * 80
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(sim_url + "/v1/chat/completions", json=body) as resp,
    ):
        await resp.read()


def _demo_banner(proxy: str, admin: str, sim: str, settings: Settings, mode: str) -> str:
    chat = "/v1/chat/completions -H 'Content-Type: application/json'"
    long_prompt = "$(printf 'overlong-prompt %.0s' $(seq 400))"
    engines = json_engines(settings)
    tokenizer = effective_tokenizer(settings.tokenizer, settings.engines)
    if tokenizer != settings.tokenizer:
        tokenizer += f" ({settings.tokenizer})"
    tenants = ", ".join(c.tenant for c in settings.canaries)
    gate_note = (
        " (it fails on\nthe engines' posture alone: the demo engine is the vulnerable one,"
        " on purpose)"
        if mode == "vulnerable"
        else ""
    )
    return f"""
kvproxy demo: the built-in PD simulator ({mode} mode) behind kvproxy
  proxy    {proxy}
  admin    {admin}/capacity  {admin}/metrics  {admin}/readyz
  sim      {sim}  (router; ground truth at {sim}/sim/stats)
  policy   tokenizer {tokenizer}; declared context {settings.max_context:,} (what the prefill
           pool holds); tripwire armed for {tenants} ({settings.tenant_header})

Check it as a release would: the isolation test through kvproxy, then the gate{gate_note}:
  kvproxy canary --target {proxy} --proxy-admin {admin} --sim {sim}
  kvproxy check --engines '{engines}' --max-context {settings.max_context} \\
    --proxy {proxy} --proxy-admin {admin} --sim {sim}

Stream a reply through the proxy:
  curl -N {proxy}{chat} \\
    -d '{{"model":"sim","stream":true,"max_tokens":48,"messages":[{{"role":"user","content":"Hello kvproxy, tenant A canary KVCANARY-A-0123456789abcdef"}}]}}'

The incident, straight to the simulator: an over-long prompt from tenant B gets HTTP 200
whose text is tenant A's (the demo seeded A's notes, marked {DEMO_CANARY}):
  curl -s {sim}{chat} \\
    -d "{{\\"max_tokens\\":400,\\"messages\\":[{{\\"role\\":\\"user\\",\\"content\\":\\"{long_prompt}\\"}}]}}"

The same request through kvproxy (400 context_length_exceeded, nothing reaches the engine):
  curl -s {proxy}{chat} \\
    -d "{{\\"max_tokens\\":400,\\"messages\\":[{{\\"role\\":\\"user\\",\\"content\\":\\"{long_prompt}\\"}}]}}"
"""


def json_engines(settings: Settings) -> str:
    """The engines as `--engines` takes them (url and role; kind when not sglang)."""
    rows = [
        {"url": e.url, "role": e.role, **({"kind": e.kind} if e.kind != "sglang" else {})}
        for e in settings.engines
    ]
    return orjson.dumps(rows).decode()


def cmd_sim(args: argparse.Namespace) -> int:
    from kvproxy.sim import run

    return run(args)


def cmd_check(args: argparse.Namespace) -> int:
    from kvproxy.tools import check_cli

    return check_cli.run_check(args)


def cmd_canary(args: argparse.Namespace) -> int:
    from kvproxy.tools import canary_cli

    return canary_cli.run_canary(args)


def _demo_args(p: argparse.ArgumentParser) -> None:
    _serve_args(p)
    p.add_argument("--sim-port", type=int, default=30000)
    p.add_argument("--mode", choices=["vulnerable", "fixed"], default="vulnerable")


def _sim_args(p: argparse.ArgumentParser) -> None:
    from kvproxy.sim import add_arguments

    add_arguments(p)


def _check_args(p: argparse.ArgumentParser) -> None:
    from kvproxy.tools import check_cli

    check_cli.add_arguments(p)


def _canary_args(p: argparse.ArgumentParser) -> None:
    from kvproxy.tools import canary_cli

    canary_cli.add_arguments(p)


# name -> (help, arguments, run). A subcommand's module is imported only when it runs, and
# its arguments only when it is the one being parsed, so one command's dependencies can never
# break another's: a plain `pip install kvproxy` serves, checks and runs the canary harness.
COMMANDS: dict[
    str,
    tuple[
        str,
        Callable[[argparse.ArgumentParser], None],
        Callable[[argparse.Namespace], int],
    ],
] = {
    "serve": ("run the proxy", _serve_args, cmd_serve),
    "demo": ("the proxy in front of the built-in PD simulator", _demo_args, cmd_demo),
    "sim": ("the PD engine simulator (prefill, decode, router)", _sim_args, cmd_sim),
    "check": ("release gate: measure, compare, probe, record", _check_args, cmd_check),
    "canary": ("two-tenant isolation test", _canary_args, cmd_canary),
}

# Optional packages, by top-level module name -> the extra that installs them.
EXTRAS = {"tokenizers": "tokenizers", "tiktoken": "tokenizers"}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the named subcommand gets its arguments (and imports
    its module). Without, every subcommand is complete (for help and tests)."""
    chosen = next((w for w in argv if w in COMMANDS), None) if argv is not None else None
    parser = argparse.ArgumentParser(prog="kvproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if chosen is None or chosen == name:
            arguments(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvproxy: {redact(str(exc))}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        command = next((w for w in argv if w in COMMANDS), "this command")
        print(
            f"kvproxy: {command} needs the Python package {missing!r}, which a plain install "
            f"leaves out: pip install 'kvproxy[{EXTRAS[missing]}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
