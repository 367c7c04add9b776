"""`record` (kvproxy.policy.records): the per-request value types are immutable where it is
checked, by mypy in `make lint`, and plain slotted dataclasses at run time."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvproxy.policy import TokenCount, record

RECORDS = Path(__file__).resolve().parents[2] / "kvproxy" / "policy" / "records.py"

SNIPPET = """
from kvproxy.policy.records import record


@record
class Pair:
    a: int
    b: str = "x"


p = Pair(1)
print(p.a + len(p.b))
{mutation}
"""


def _mypy(tmp_path: Path, mutation: str) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "snippet.py"
    src.write_text(SNIPPET.format(mutation=mutation))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=skip",
         "--cache-dir", str(tmp_path / "cache"), str(src), str(RECORDS)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_mypy_refuses_an_assignment_to_a_record_field(tmp_path: Path) -> None:
    clean = _mypy(tmp_path, "")
    assert clean.returncode == 0, clean.stdout
    mutated = _mypy(tmp_path, "p.a = 2")
    assert mutated.returncode == 1
    assert 'Property "a" defined in "Pair" is read-only' in mutated.stdout


def test_records_are_slotted_dataclasses_without_the_frozen_runtime_cost() -> None:
    @record
    class Pair:
        a: int
        b: str = "x"

    p = Pair(1)
    assert dataclasses.is_dataclass(p)
    assert not hasattr(p, "__dict__")
    assert p == Pair(1, "x")
    assert p != Pair(2)
    with pytest.raises(AttributeError):
        p.c = 3  # type: ignore[attr-defined]  # slots: no field outside the declared ones
    # The per-request types are records: built without object.__setattr__ per field.
    params = TokenCount.__dataclass_params__  # type: ignore[attr-defined]
    assert not params.frozen
    with pytest.raises(TypeError):
        hash(TokenCount(1, "bound", exact=False, total_tokens=1))  # never a key
