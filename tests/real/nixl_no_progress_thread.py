"""A .pth hook in the real-engine suite's vLLM venv (install_vllm.sh); runs in vLLM, not here.

NIXL's UCX progress thread busy-polls (nixl_agent sets its delay, `pthrDelay`, to 0): on CPU
each idle vLLM worker then burns a whole core (measured: 10 CPU-s per 10 s idle, both cores).
Turning the thread off instead hung transfers: over UCX's TCP/shared-memory transports the
side that serves a read (prefill) must progress too, and an idle prefill worker never does,
so a decode's first read waited until prefill's KV lease expired (seen 2026-12-06: 9 min,
"retrieved by 0 remote worker(s)"). So the thread stays on and sleeps
NIXL_PROG_THREAD_DELAY_US (default 1000 us) between polls. NIXL_PROG_THREAD=1 keeps NIXL's
default (delay 0).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_NAMES = ("nixl_cu12._api", "nixl_cu13._api")


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _NAMES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            real = module.nixlBind
            delay = int(os.environ.get("NIXL_PROG_THREAD_DELAY_US", "1000"))

            class _Bind:
                # nixl_agent builds its config, sets pthrDelay = 0, then calls nixlAgent:
                # the delay is set last, here.
                def __getattr__(self, name: str) -> Any:
                    return getattr(real, name)

                @staticmethod
                def nixlAgent(name: str, config: Any) -> Any:
                    config.useProgThread = True
                    config.pthrDelay = delay
                    return real.nixlAgent(name, config)

            module.nixlBind = _Bind()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("NIXL_PROG_THREAD", "0") != "1":
    sys.meta_path.insert(0, _Hook())
