"""`record`: the decorator of kvproxy's per-request value types (a prompt's shape, a count,
a decision, a drain event): immutable by declaration, checked where it is cheap.

A `record` class is a slotted dataclass that mypy treats as frozen (`dataclass_transform`
with `frozen_default`): `mypy --strict` (make lint, the first step of CI) refuses any
assignment to a field. At run time it is not frozen: a frozen dataclass sets each field
through `object.__setattr__`, and with ~50 fields built per small request that was 6 % of
kvproxy's instructions per request (callgrind, bench/instructions.py). No code path needs
the run-time check, and none hashes these values (eq without frozen makes them unhashable:
a use as a key would fail loudly, not silently)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def record(cls: type[T]) -> type[T]:
    return dataclass(slots=True)(cls)


__all__ = ["record"]
