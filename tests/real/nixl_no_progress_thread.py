"""A .pth hook in the real-engine suite's vLLM venv (install_vllm.sh); runs in vLLM, not here.

NIXL's UCX progress thread busy-polls: on CPU each idle vLLM worker then burns a whole core
(measured: 10 CPU-s per 10 s idle, both cores). vLLM does not expose
nixl_agent_config(enable_prog_thread=...), so this defaults it to False; vLLM's connector still
drives transfers from its own loop. NIXL_PROG_THREAD=1 keeps NIXL's default.
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
            init = module.nixl_agent_config.__init__

            def patched(config: Any, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("enable_prog_thread", False)
                init(config, *args, **kwargs)

            module.nixl_agent_config.__init__ = patched

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("NIXL_PROG_THREAD", "0") != "1":
    sys.meta_path.insert(0, _Hook())
