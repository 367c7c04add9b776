"""What a run reports about itself: package and tool versions, the commit, the commands;
and the peers' install (LiteLLM into bench/out/peers-venv, `make bench-peers` only).

Must never: install anything into the project's venv.
"""

from __future__ import annotations

import importlib.metadata as md
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import procstat
import targets

BENCH = Path(__file__).resolve().parent


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("kvproxy", "aiohttp", "uvloop", "tokenizers", "prometheus-client"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    out["litellm"] = peer_version("litellm")
    out["nginx"] = procstat.tool_version("nginx")
    out["wrk"] = procstat.tool_version("wrk")
    git = subprocess.run(
        ["git", "-C", str(BENCH.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", str(BENCH.parent), "status", "--porcelain", "kvproxy"],
        capture_output=True,
        text=True,
        check=False,
    )
    out["kvproxy commit"] = git.stdout.strip() + (
        " (+ uncommitted kvproxy/ changes)" if dirty.stdout.strip() else ""
    )
    return out


def peer_version(pkg: str) -> str:
    # The dist-info directory names the version; `pip show` would take two seconds.
    found = sorted(targets.PEERS_VENV.glob(f"lib/python*/site-packages/{pkg}-*.dist-info"))
    if not found:
        return "not installed"
    version = found[-1].name[len(pkg) + 1 : -len(".dist-info")]
    return f"{version} (bench/out/peers-venv)"


def install_litellm() -> str | None:
    """`pip install 'litellm[proxy]'` into bench/out/peers-venv (once); None on success,
    else why not."""
    if targets.litellm_available() is None:
        return None
    venv = targets.PEERS_VENV
    print(f"installing litellm[proxy] into {venv} (bench-peers only)", flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            "--disable-pip-version-check",
            "litellm[proxy]",
        ],
    ]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except subprocess.TimeoutExpired:
            return f"{shlex.join(cmd)} timed out after 900 s"
        if done.returncode != 0:
            return f"{shlex.join(cmd)} failed: " + done.stderr.strip()[-300:]
    return targets.litellm_available()


def commands(meta: dict[str, Any]) -> list[str]:
    return [
        "make bench            # = .venv/bin/python bench/run.py",
        "make bench-peers      # = .venv/bin/python bench/run.py --peers (installs litellm)",
        f"this run: {meta['command']}",
        "pinning: taskset -c 0 <server>; taskset -c 1 wrk -t1 -cN -dDs -s load.lua URL "
        "(the harness itself runs on CPU 1)",
    ]
