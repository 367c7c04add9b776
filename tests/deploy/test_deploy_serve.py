"""The real `kvproxy serve`, started with an overlay's rendered kvproxy.yaml.

Proves what the manifests assume of the process: it starts from that file, answers the
probe paths on the admin port (startup/liveness /healthz 200; readiness /readyz 503 while no
engine is measured: fail closed), and exports the gauge the router's preStop hook waits on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from deploytest import container, mounted_config, one, pod_spec, render
from ports import free_port

HOOK = Path(__file__).resolve().parents[2] / "deploy/base/hooks/wait_for_kvproxy_drain.py"
START_TIMEOUT_S = 30.0


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            code: int = response.status
            return code
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """Admin base URL of a kvproxy serving the sglang-pd overlay's config on free ports."""
    objs = render("overlays/sglang-pd")
    spec = pod_spec(one(objs, "Deployment", "kvproxy"))
    cfg = mounted_config(objs, spec)
    admin = f"127.0.0.1:{free_port()}"
    cfg.update(listen=f"127.0.0.1:{free_port()}", admin_listen=admin)
    config = tmp_path / "kvproxy.yaml"
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVPROXY_")}
    env.update({e["name"]: e["value"] for e in container(spec, "kvproxy")["env"]})
    env.update(KVPROXY_CONFIG=str(config), HOME=str(tmp_path))
    log = (tmp_path / "serve.log").open("wb")
    # The image's ENTRYPOINT is `kvproxy serve`; the module form runs the same main().
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvproxy", "serve"], env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"kvproxy serve did not come up:\n{(tmp_path / 'serve.log').read_text()}"
                )
            try:
                if status(f"http://{admin}/healthz") == 200:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        yield f"http://{admin}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_probe_paths_and_the_drain_gauge_on_the_admin_port(served: str) -> None:
    assert status(f"{served}/healthz") == 200
    # The overlay's engines do not resolve here: nothing is measured, so not ready (I3).
    assert status(f"{served}/readyz") == 503
    with urllib.request.urlopen(f"{served}/metrics", timeout=5) as response:
        assert b"\nkvproxy_inflight_requests " in response.read()
    proc = subprocess.run(
        [
            sys.executable,
            str(HOOK),
            f"--metrics-url={served}/metrics",
            "--endpoint-delay-s=0",
            "--max-wait-s=30",
            "--poll-interval-s=0.05",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert "nothing in flight" in proc.stderr
