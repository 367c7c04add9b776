"""A .pth hook in the real-engine suite's vLLM venv (install_vllm.sh); runs in vLLM, not here.

After every step a vLLM worker busy-loops (sched_yield) for 1 s on its shared-memory queue
before it sleeps (vllm's SpinCondition, busy_loop_s=1, no setting for it). With two engines on
2 cores the idle engine's spin slows the busy one (measured: a PD request ~1 s instead of
~0.1 s). This sets the spin to VLLM_SHM_BUSY_LOOP_S (default 0.1 s; 0 stalled decode steps for
seconds in one run: lost wake-ups).
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

_NAME = "vllm.distributed.device_communicators.shm_broadcast"


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            init = module.SpinCondition.__init__
            spin = float(os.environ.get("VLLM_SHM_BUSY_LOOP_S", "0.1"))

            def patched(cond: Any, *args: Any, **kwargs: Any) -> None:
                init(cond, *args, **kwargs)
                if getattr(cond, "is_reader", False):
                    cond.busy_loop_s = spin

            module.SpinCondition.__init__ = patched

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Hook())
