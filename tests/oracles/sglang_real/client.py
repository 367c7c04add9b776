"""Start `worker.py` under SGLang's venv and ask it for counts, in batches over its pipes.

    with RealSglang(venv, model_dir, served_model_name="tiny") as real:
        answers = real.count_many([("chat", body_bytes), ...])   # [{"tokens": [n]} | ...]

The worker runs in a process group of its own, stopped (SIGTERM, then SIGKILL) on exit;
every read from it is bounded, so a stuck worker fails the test instead of hanging it.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

SGLANG_VERSION = "0.5.23"
WORKER = Path(__file__).with_name("worker.py")
DEFAULT_VENV = Path.home() / ".cache" / "kvproxy" / f"venv-sglang-{SGLANG_VERSION}"
# Imports take 6-17 s on a quiet machine; a loaded 2-core one is several times slower.
START_TIMEOUT_S = 300.0
# Per batch: ~1-2 ms a body when quiet.
BATCH_TIMEOUT_S = 300.0
BATCH = 200


def venv_path() -> Path:
    return Path(os.environ.get("KVPROXY_SGLANG_VENV") or DEFAULT_VENV)


class WorkerFailed(RuntimeError):
    pass


class RealSglang:
    def __init__(self, venv: Path, model_dir: Path, served_model_name: str) -> None:
        python = venv / "bin" / "python"
        if not python.is_file():
            raise WorkerFailed(f"no SGLang venv at {venv}: run `make sglang-real`")
        self.proc = subprocess.Popen(
            [
                str(python),
                str(WORKER),
                "--model-dir",
                str(model_dir),
                "--served-model-name",
                served_model_name,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._buf = b""
        self._err = b""
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        os.set_blocking(self.proc.stderr.fileno(), False)
        self._sel.register(self.proc.stdout, selectors.EVENT_READ, "out")
        self._sel.register(self.proc.stderr, selectors.EVENT_READ, "err")
        self.ready: dict[str, Any] = json.loads(self._readline(START_TIMEOUT_S))["ready"]
        if self.ready.get("sglang") != SGLANG_VERSION:
            raise WorkerFailed(f"the venv runs SGLang {self.ready.get('sglang')}")

    def _readline(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailed(f"no answer in {timeout_s:.0f} s; stderr:\n{self.stderr()}")
            for key, _ in self._sel.select(min(left, 1.0)):
                chunk = os.read(key.fileobj.fileno(), 1 << 20)  # type: ignore[union-attr]
                if key.data == "out":
                    if not chunk:
                        raise WorkerFailed(f"the worker exited; stderr:\n{self.stderr()}")
                    self._buf += chunk
                else:
                    self._err = (self._err + chunk)[-20000:]
            if self.proc.poll() is not None and b"\n" not in self._buf:
                raise WorkerFailed(f"the worker exited; stderr:\n{self.stderr()}")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def stderr(self) -> str:
        return self._err.decode(errors="replace")[-4000:]

    def count_many(self, items: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
        """SGLang's answer for each (route, body), in order."""
        out: list[dict[str, Any]] = []
        assert self.proc.stdin is not None
        for i in range(0, len(items), BATCH):
            chunk = [
                {"route": route, "body": base64.b64encode(body).decode()}
                for route, body in items[i : i + BATCH]
            ]
            self.proc.stdin.write(json.dumps(chunk).encode() + b"\n")
            self.proc.stdin.flush()
            answers = json.loads(self._readline(BATCH_TIMEOUT_S))
            if len(answers) != len(chunk):
                raise WorkerFailed(f"{len(answers)} answers for {len(chunk)} bodies")
            out.extend(answers)
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._sel.close()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

    def __enter__(self) -> RealSglang:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
