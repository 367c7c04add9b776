"""The policy modules are sans-IO (h11's discipline): importing them, transitively, loads
no network stack, no event loop and no metrics library. Each is imported in a fresh
interpreter, because in this one the test runner has loaded all three already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("aiohttp", "asyncio", "prometheus_client", "uvloop", "redis")

SANS_IO = (
    "kvproxy.policy.drain",
    "kvproxy.policy.admission",
    "kvproxy.policy.counts",
    "kvproxy.prompt.parse",
    "kvproxy.prompt.shape",
    "kvproxy.prompt.chat",
    "kvproxy.prompt.converted",
    "kvproxy.prompt.prompt_only",
    "kvproxy.policy.errors",
    "kvproxy.response.inspector",
    "kvproxy.response.guard",
    "kvproxy.response.tripwire",
    "kvproxy.response.payload",
    "kvproxy.response.sse",
    "kvproxy.response.usage",
    "kvproxy.policy.origin",
    "kvproxy.response.head",
)

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_by(module: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, module], check=True, capture_output=True, text=True
    ).stdout
    return set(json.loads(out))


@pytest.mark.parametrize("module", SANS_IO)
def test_policy_module_imports_no_io(module: str) -> None:
    loaded = _loaded_by(module)
    bad = sorted(name for name in loaded if name.split(".")[0] in FORBIDDEN and "." not in name)
    ours = sorted(name for name in loaded if name.startswith("kvproxy"))
    assert not bad, f"{module} pulls in {bad} through {ours}"


def test_the_probe_would_see_an_io_import() -> None:
    # The check is not vacuous: a module that does use the network stack is caught.
    assert "aiohttp" in _loaded_by("kvproxy.serve.relay")
