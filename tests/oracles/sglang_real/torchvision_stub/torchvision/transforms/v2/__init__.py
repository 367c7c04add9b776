from typing import Any

from torchvision import _Stub

from . import functional  # noqa: F401


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub
