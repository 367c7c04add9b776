"""Starting and stopping the simulator: options, the in-process cluster, the CLI.

Owns: ``SimOptions`` (one flat dataclass; its defaults are the demo: context 8192,
prefill pool 5,322 tokens, decode pool 16,384, page 16, vulnerable), ``SimCluster``
(prefill + decode + the built-in router in this event loop, with ``stop_server`` /
``start_server`` that rebind the same port so tests can restart an engine with a smaller
pool or take it down), and ``add_arguments`` / ``run`` for ``kvproxy sim``.

Two scale facts a reader needs: pools are rounded down to whole pages as SGLang does
(5,322 → 5,312), so prefill's ``max_req_input_len`` is 5,306; and ``--mode`` sets the
three failure switches at once, each of which can be overridden on its own. The posture the
engines report follows the mode too, so what ``/server_info`` says matches how the engines
behave: vulnerable reports ``0.5.21-sim`` (before every fix the incident names) without KV
checksums; fixed reports ``0.5.23-sim`` (at or after each fix, NIXL/MORI's included) with
``--disaggregation-enable-kv-checksum`` on both engines. ``--version`` and
``--kv-checksum``/``--no-kv-checksum`` override either.

The engines' own arithmetic cases are options too: ``--speculative-algorithm EAGLE`` with
its sizes (SGLang's context reserve), ``--dcp-size`` (SGLang decode context parallelism),
``--dp-size`` with ``--no-kv-cache-size-label`` (vLLM data parallelism as builds before
PR #42206 report it).

Independent oracle: never imports kvproxy code outside ``kvproxy/sim``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
from dataclasses import dataclass
from typing import Any, Literal

from kvproxy.sim.decode import DecodeServer
from kvproxy.sim.engine import EngineServer
from kvproxy.sim.prefill import PrefillServer
from kvproxy.sim.router import PDRouter
from kvproxy.sim.state import FIXED_SIM_VERSION, SIM_VERSION, EngineConfig, Faults

Mode = Literal["vulnerable", "fixed"]
SimRole = Literal["all", "prefill", "decode"]
SWITCHES = ("pending_rejection_transfers", "free_on_abort", "failed_send_as_drained")


@dataclass
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    prefill_port: int | None = None  # None: port + 1 (any free port when port is 0)
    decode_port: int | None = None  # None: port + 2 (any free port when port is 0)
    mode: Mode = "vulnerable"
    # Failure switches; None follows ``mode`` (vulnerable: on, fixed: off).
    pending_rejection_transfers: bool | None = None
    free_on_abort: bool | None = None
    failed_send_as_drained: bool | None = None
    flavor: Literal["sglang", "vllm"] = "sglang"
    context_length: int = 8192
    prefill_pool_tokens: int = 5322
    decode_pool_tokens: int = 16384
    page_size: int = 16
    tokenizer: str | None = None
    # A 5k-token prompt: ~0.2 s of prefill, ~0.33 s of transfer; 1 ms per echoed token.
    prefill_us_per_token: float = 40.0
    transfer_ms_per_page: float = 1.0
    decode_ms_per_token: float = 1.0
    transfer_batch_pages: int = 0
    transfer_failure_probability: float = 0.0
    abort_ack_timeout_s: float = 30.0
    bootstrap_timeout_s: float = 30.0
    seed: int = 0
    role: SimRole = "all"
    allow_auto_truncate: bool = False
    model_name: str = "kvproxy-sim"
    # The engines' own arithmetic cases (both engines get them): SGLang EAGLE reserve,
    # SGLang DCP, vLLM DP without the kv_cache_size_tokens label.
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    dcp_size: int = 1
    dp_size: int = 1
    kv_cache_size_label: bool = True
    # Posture as /server_info reports it (SGLang flavour): the version string, the transfer
    # backend, and --disaggregation-enable-kv-checksum on both engines (kvproxy.sim.checksum).
    # None follows ``mode`` (vulnerable: SIM_VERSION, no checksum; fixed: FIXED_SIM_VERSION,
    # checksum on), so a fixed simulator passes the release gate's posture check as it is.
    engine_version: str | None = None
    transfer_backend: Literal["mooncake", "nixl", "mori"] = "mooncake"
    kv_checksum: bool | None = None

    def switch(self, name: str) -> bool:
        value = getattr(self, name)
        return self.mode == "vulnerable" if value is None else bool(value)

    def version(self) -> str:
        """The version /server_info reports."""
        if self.engine_version is not None:
            return self.engine_version
        return SIM_VERSION if self.mode == "vulnerable" else FIXED_SIM_VERSION

    def checksum(self) -> bool:
        """Whether both engines run with --disaggregation-enable-kv-checksum."""
        return self.mode == "fixed" if self.kv_checksum is None else self.kv_checksum

    def faults(self) -> Faults:
        return Faults(
            transfer_failure_probability=self.transfer_failure_probability,
            prefill_us_per_token=self.prefill_us_per_token,
            transfer_ms_per_page=self.transfer_ms_per_page,
            decode_ms_per_token=self.decode_ms_per_token,
            transfer_batch_pages=self.transfer_batch_pages,
            abort_ack_timeout_s=self.abort_ack_timeout_s,
        )


class SimCluster:
    """Prefill, decode and router (per ``opts.role``) running in the current loop."""

    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.servers: dict[str, EngineServer] = {}
        self.router: PDRouter | None = None
        self._ports: dict[str, int] = {}
        self._overrides: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}

    # -- urls ------------------------------------------------------------------------------

    def _url(self, role: str) -> str:
        return f"http://{self.opts.host}:{self._ports[role]}"

    @property
    def router_url(self) -> str:
        if self.opts.role != "all":
            return self._url(self.opts.role)
        return self._url("router")

    @property
    def prefill_url(self) -> str:
        return self._url("prefill")

    @property
    def decode_url(self) -> str:
        return self._url("decode")

    # -- lifecycle ------------------------------------------------------------------------

    def _wanted_port(self, role: str) -> int:
        o = self.opts
        if o.role != "all":
            return o.port
        explicit = {"prefill": o.prefill_port, "decode": o.decode_port}.get(role)
        if role == "router":
            return o.port
        if explicit is not None:
            return explicit
        if o.port == 0:
            return 0
        return o.port + (1 if role == "prefill" else 2)

    def _config(
        self, role: Literal["prefill", "decode"], port: int, overrides: dict[str, Any]
    ) -> EngineConfig:
        o = self.opts
        pool = o.prefill_pool_tokens if role == "prefill" else o.decode_pool_tokens
        prefill_port = self._ports.get("prefill", o.prefill_port or 8998)
        base = EngineConfig(
            role=role,
            host=o.host,
            port=port,
            flavor=o.flavor,
            context_length=o.context_length,
            pool_tokens=pool,
            page_size=o.page_size,
            tokenizer=o.tokenizer,
            model_name=o.model_name,
            seed=o.seed + (0 if role == "prefill" else 1),
            allow_auto_truncate=o.allow_auto_truncate,
            speculative_algorithm=o.speculative_algorithm,
            speculative_num_steps=o.speculative_num_steps,
            speculative_eagle_topk=o.speculative_eagle_topk,
            speculative_num_draft_tokens=o.speculative_num_draft_tokens,
            dcp_size=o.dcp_size,
            dp_size=o.dp_size,
            kv_cache_size_label=o.kv_cache_size_label,
            pending_rejection_transfers=o.switch("pending_rejection_transfers"),
            free_on_abort=o.switch("free_on_abort"),
            failed_send_as_drained=o.switch("failed_send_as_drained"),
            default_bootstrap_port=prefill_port,
            bootstrap_timeout_s=o.bootstrap_timeout_s,
            version=o.version(),
            transfer_backend=o.transfer_backend,
            kv_checksum=o.checksum(),
        )
        return dataclasses.replace(base, **overrides)

    async def start(self) -> None:
        roles: list[Literal["prefill", "decode"]] = (
            ["prefill", "decode"] if self.opts.role == "all" else [self.opts.role]
        )
        try:
            for role in roles:
                await self.start_server(role)
            if self.opts.role == "all":
                router = PDRouter(
                    self.opts.host,
                    self._wanted_port("router"),
                    self.prefill_url,
                    self.decode_url,
                    bootstrap_port=self._ports["prefill"],
                    seed=self.opts.seed,
                )
                await router.start()
                self.router = router
                self._ports["router"] = router.port
        except BaseException:
            await self.close()
            raise

    async def start_server(self, role: Literal["prefill", "decode"], **overrides: Any) -> None:
        """(Re)start one engine on its previous port; ``overrides`` are EngineConfig fields
        (e.g. ``pool_tokens=4096``) and stick across later restarts."""
        if role in self.servers:
            raise RuntimeError(f"{role} server is already running")
        self._overrides[role].update(overrides)
        port = self._ports.get(role, self._wanted_port(role))
        config = self._config(role, port, self._overrides[role])
        kind = PrefillServer if role == "prefill" else DecodeServer
        server = kind(config, self.opts.faults())
        await server.start()
        self.servers[role] = server
        self._ports[role] = server.port

    async def stop_server(self, role: Literal["prefill", "decode"]) -> None:
        server = self.servers.pop(role, None)
        if server is not None:
            await server.close()

    async def set_pool_tokens(self, role: Literal["prefill", "decode"], pool_tokens: int) -> None:
        """The engine restarts with a different pool, on the same port."""
        await self.stop_server(role)
        await self.start_server(role, pool_tokens=pool_tokens)

    async def close(self) -> None:
        if self.router is not None:
            await self.router.close()
            self.router = None
        for role in list(self.servers):
            await self.stop_server(role)  # type: ignore[arg-type]

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimOptions()
    a = parser.add_argument
    a("--host", default=d.host)
    a("--port", type=int, default=d.port, help="router port (or the one engine's, with --role)")
    a("--prefill-port", type=int, default=None, help="default: --port + 1")
    a("--decode-port", type=int, default=None, help="default: --port + 2")
    a("--role", choices=["all", "prefill", "decode"], default=d.role)
    a(
        "--mode",
        choices=["vulnerable", "fixed"],
        default=d.mode,
        help="vulnerable turns every failure switch on, fixed turns them off",
    )
    for name in SWITCHES:
        flag = "--" + name.replace("_", "-")
        a(
            flag,
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"override --mode for this failure mode ({name})",
        )
    a("--flavor", choices=["sglang", "vllm"], default=d.flavor)
    a("--context-length", type=int, default=d.context_length)
    a("--prefill-pool-tokens", type=int, default=d.prefill_pool_tokens)
    a("--decode-pool-tokens", type=int, default=d.decode_pool_tokens)
    a("--page-size", type=int, default=d.page_size)
    a("--tokenizer", default=None, help="HF tokenizer.json, its .zip, or its directory")
    a("--prefill-us-per-token", type=float, default=d.prefill_us_per_token)
    a("--transfer-ms-per-page", type=float, default=d.transfer_ms_per_page)
    a("--decode-ms-per-token", type=float, default=d.decode_ms_per_token)
    a(
        "--transfer-batch-pages",
        type=int,
        default=d.transfer_batch_pages,
        help="pages per transfer batch; 0: the whole request in one batch",
    )
    a("--transfer-failure-probability", type=float, default=d.transfer_failure_probability)
    a("--abort-ack-timeout-s", type=float, default=d.abort_ack_timeout_s)
    a("--seed", type=int, default=d.seed)
    a("--allow-auto-truncate", action="store_true")
    a("--model-name", default=d.model_name)
    a("--speculative-algorithm", default=None, help="SGLang: e.g. EAGLE (reserves drafts)")
    a("--speculative-num-steps", type=int, default=None)
    a("--speculative-eagle-topk", type=int, default=None)
    a("--speculative-num-draft-tokens", type=int, default=None)
    a("--dcp-size", type=int, default=d.dcp_size, help="SGLang decode context parallel size")
    a("--dp-size", type=int, default=d.dp_size, help="vLLM data-parallel engines")
    a(
        "--kv-cache-size-label",
        action=argparse.BooleanOptionalAction,
        default=d.kv_cache_size_label,
        help="vLLM: export kv_cache_size_tokens (builds since PR #42206)",
    )
    a(
        "--version",
        dest="engine_version",
        default=None,
        help=f"the SGLang version /server_info reports (default: {SIM_VERSION} with --mode "
        f"vulnerable, {FIXED_SIM_VERSION} with --mode fixed; reporting only: --mode decides "
        "the behaviour)",
    )
    a("--transfer-backend", choices=["mooncake", "nixl", "mori"], default=d.transfer_backend)
    a(
        "--kv-checksum",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--disaggregation-enable-kv-checksum on both engines: a transfer whose landed KV "
        "does not match prefill's digest is aborted and counted instead of read (default: "
        "on with --mode fixed, off with --mode vulnerable)",
    )


def options_from_args(args: argparse.Namespace) -> SimOptions:
    names = {f.name for f in dataclasses.fields(SimOptions)}
    return SimOptions(**{k: v for k, v in vars(args).items() if k in names})


async def _serve(opts: SimOptions) -> None:
    async with SimCluster(opts) as cluster:
        if opts.role == "all":
            posture = f"{opts.version()}, KV checksum {'on' if opts.checksum() else 'off'}"
            print(
                f"kvproxy sim ({opts.mode}, {opts.flavor}, {posture}) router  {cluster.router_url}"
            )
            print(f"kvproxy sim prefill {cluster.prefill_url}")
            print(f"kvproxy sim decode  {cluster.decode_url}")
            print(f"ground truth: curl -s {cluster.router_url}/sim/stats", flush=True)
        else:
            print(
                f"kvproxy sim {opts.role} ({opts.mode}, {opts.flavor}) {cluster.router_url}",
                flush=True,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    """Blocks until SIGINT/SIGTERM; returns the process exit status."""
    opts = options_from_args(args)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(_serve(opts))
    except (OSError, ValueError) as exc:
        print(f"kvproxy sim: {exc}")
        return 1
    return 0
