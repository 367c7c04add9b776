"""The things being measured, each started against a given upstream and stopped after.

Owns: `direct` (no proxy), `nginx` (the floor), `bare` (aiohttp alone), `kvproxy` (full
policy: real tokenizer, capacity from a simulator engine's admin API, canaries for two
tenants, metrics, access log) and `litellm` (the peer, optional). Every proxy runs pinned
to `SERVER_CPU`; its CPU is the CPU of the pids listed in `Running.pids`.
Must never: share a process between two targets, or measure a process it did not start.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nginx
from payloads import API_KEY
from servers import Managed, StartError, free_port, wait_http, wait_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
SERVER_CPU = 0
LOAD_CPU = 1

# The product's own entry point, configured through KVPROXY_* like a deployment.
KVPROXY_CMD = (PY, "-m", "kvproxy", "serve")
TENANTS = ("acme", "globex")
# Markers the canary tripwire scans every response for; the upstreams never emit them.
CANARIES = [
    {
        "tenant": t,
        "markers": [f"KVCANARY-{t}-0123456789abcdef"],
        "patterns": [f"KVCANARY-{t}-[0-9a-f]{{16}}"],
    }
    for t in TENANTS
]


@dataclass
class Running:
    name: str
    url: str
    pids: list[int]
    procs: list[Managed] = field(default_factory=list)
    admin_url: str | None = None
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


@dataclass(frozen=True)
class Upstream:
    """Where the targets forward to: a URL and the process serving it."""

    url: str
    port: int
    pid: int


def start_direct(up: Upstream, workdir: Path) -> Running:
    return Running("direct", up.url, [up.pid])


def start_nginx(up: Upstream, workdir: Path) -> Running:
    port = free_port()
    m = nginx.start_proxy(workdir / f"nginx-{port}", port, up.port, cpu=SERVER_CPU)
    return Running("nginx", f"http://127.0.0.1:{port}", [m.pid], [m])


def start_bare(up: Upstream, workdir: Path, max_connections: int = 1024) -> Running:
    port = free_port()
    cmd = [PY, str(BENCH / "bare_forwarder.py"), "--port", str(port), "--upstream", up.url,
           "--max-connections", str(max_connections)]  # fmt: skip
    m = Managed("bare", cmd, cpu=SERVER_CPU, log=workdir / f"bare-{port}.log").start()
    wait_port(port, proc=m)
    return Running("bare", f"http://127.0.0.1:{port}", [m.pid], [m])


def bare_starter(max_connections: int) -> Callable[[Upstream, Path], Running]:
    def start(up: Upstream, workdir: Path) -> Running:
        return start_bare(up, workdir, max_connections)

    return start


@dataclass(frozen=True)
class KvproxyOptions:
    """What the kvproxy target is configured with; the report prints it."""

    tokenizer: str
    engine_url: str
    extra_env: tuple[tuple[str, str], ...] = ()

    def env(self, port: int, admin_port: int, upstream: str) -> dict[str, str]:
        env = {
            "KVPROXY_LISTEN": f"127.0.0.1:{port}",
            "KVPROXY_ADMIN_LISTEN": f"127.0.0.1:{admin_port}",
            "KVPROXY_UPSTREAM": upstream,
            "KVPROXY_ENGINES": json.dumps(
                [{"url": self.engine_url, "role": "prefill", "kind": "sglang"}]
            ),
            "KVPROXY_TOKENIZER": self.tokenizer,
            "KVPROXY_CANARIES": json.dumps(CANARIES),
            "KVPROXY_TRUST_TENANT_HEADER": "true",
            "KVPROXY_ACCESS_LOG": "true",
            "KVPROXY_LOG_LEVEL": "info",
        }
        env.update(dict(self.extra_env))
        return env


def start_kvproxy(up: Upstream, workdir: Path, opts: KvproxyOptions) -> Running:
    port, admin = free_port(), free_port()
    env = opts.env(port, admin, up.url)
    cmd = list(KVPROXY_CMD)
    # Access log on, written to /dev/null: the cost of formatting it is part of the policy,
    # the disk is not. On a failed start, run again with the log kept to say why.
    m = Managed("kvproxy", cmd, cpu=SERVER_CPU, log=None, env=env).start()
    try:
        wait_http(f"http://127.0.0.1:{admin}/readyz", timeout_s=60, proc=m)
    except StartError:
        m.stop()
        diag = Managed(
            "kvproxy", cmd, cpu=SERVER_CPU, log=workdir / f"kvproxy-{port}.log", env=env
        ).start()
        try:
            wait_http(f"http://127.0.0.1:{admin}/readyz", timeout_s=30, proc=diag)
        except StartError as exc:
            diag.stop()
            raise StartError(f"kvproxy did not become ready: {exc}") from None
        m = diag
    return Running(
        "kvproxy", f"http://127.0.0.1:{port}", [m.pid], [m], admin_url=f"http://127.0.0.1:{admin}"
    )


def kvproxy_starter(opts: KvproxyOptions) -> Callable[[Upstream, Path], Running]:
    def start(up: Upstream, workdir: Path) -> Running:
        return start_kvproxy(up, workdir, opts)

    return start


def start_sim_prefill(workdir: Path, *, pool_tokens: int, name: str = "sim") -> tuple[Managed, str]:
    """One simulated SGLang prefill engine (its URL too): what kvproxy's capacity probe reads.

    Page size 64 keeps the simulator's per-page bookkeeping small at multi-million-token
    pools; the limit arithmetic does not depend on it beyond rounding."""
    port = free_port()
    cmd = [
        PY,
        "-m",
        "kvproxy.sim",
        "--role",
        "prefill",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill-pool-tokens",
        str(pool_tokens),
        "--context-length",
        str(pool_tokens),
        "--page-size",
        "64",
    ]
    m = Managed(name, cmd, cpu=LOAD_CPU, log=workdir / f"{name}-{port}.log").start()
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/server_info", timeout_s=60, proc=m)
    return m, url


def start_redis(workdir: Path) -> tuple[Managed, str] | None:
    """Debian's redis-server on a loopback port, no persistence, on the load generator's
    CPU (Redis is another process of the deployment, not kvproxy's cost); None if absent."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
           "no", "--dir", str(workdir)]  # fmt: skip
    m = Managed("redis", cmd, cpu=LOAD_CPU, log=workdir / f"redis-{port}.log").start()
    wait_port(port, timeout_s=30, proc=m)
    return m, f"redis://127.0.0.1:{port}/0"


# --- LiteLLM (bench-peers only) ---------------------------------------------------------

LITELLM_CONFIG = """
model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: {upstream}/v1
      api_key: sk-bench
    model_info:
      max_input_tokens: {limit}
router_settings:
  enable_pre_call_checks: true
litellm_settings:
  drop_params: true
  telemetry: false
"""


def litellm_starter(limit_tokens: int) -> Callable[[Upstream, Path], Running]:
    def start(up: Upstream, workdir: Path) -> Running:
        port = free_port()
        cfg = workdir / f"litellm-{port}.yaml"
        cfg.write_text(LITELLM_CONFIG.format(upstream=up.url, limit=limit_tokens))
        exe = str(LITELLM_EXE)
        cmd = [
            exe,
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]
        env = {
            "LITELLM_LOG": "ERROR",
            "LITELLM_MASTER_KEY": API_KEY,
            "LITELLM_TELEMETRY": "False",
            "NO_DOCS": "True",
            "DISABLE_ADMIN_UI": "True",
        }
        m = Managed(
            "litellm", cmd, cpu=SERVER_CPU, log=workdir / f"litellm-{port}.log", env=env
        ).start()
        try:
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout_s=120, proc=m)
        except StartError:
            m.stop()
            raise
        return Running("litellm", f"http://127.0.0.1:{port}", [m.pid], [m])

    return start


# LiteLLM lives in its own venv under bench/out/: its dependency pins (openai, pydantic,
# tokenizers, ...) must not move the project's venv under everyone else's feet.
PEERS_VENV = BENCH / "out" / "peers-venv"
LITELLM_EXE = PEERS_VENV / "bin" / "litellm"


def litellm_available() -> str | None:
    """None when the litellm proxy can be started, else why not."""
    if not LITELLM_EXE.exists():
        return f"litellm is not installed in {PEERS_VENV}"
    if not os.access(LITELLM_EXE, os.X_OK):
        return f"{LITELLM_EXE} is not executable"
    return None
