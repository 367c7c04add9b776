"""An import-only stand-in for torchvision: the index's torchvision wheels need CUDA torch,
and SGLang imports torchvision unconditionally. Enough for `import sglang...` on a CPU-only
torch; any real use of it raises. worker.py puts it on the path only when the real one
does not import."""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+stub"


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision stub: not available on this CPU-only install")

    def __getattr__(self, name: str) -> Any:
        return _Stub()


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub


from . import io, transforms  # noqa: E402, F401  (after _Stub: they import it)
