"""The advisory table: data (advisories.json, schema advisories.schema.json), loaded and
validated once at start.

An advisory says: engine E at versions [introduced, fixed_in), with one of these transfer
backends, under these server arguments, has this effect. Every entry must carry `fixed_in`
and a `source` URL, so nothing is shipped (or added by an operator) that cannot be checked.
Operators add their own file (`advisories_file`) and accept entries by id
(`accept_advisories`); an accepted id that names no entry is a configuration error, so a
typo never silently accepts nothing.

Must never: guess a version it cannot parse (that is "not observable"), or load a table
with duplicate ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

SHIPPED = Path(__file__).parent / "advisories.json"
SCHEMA_PATH = Path(__file__).parent / "advisories.schema.json"
TABLE_SCHEMA = "kvproxy.advisories/1"
_VERSION_PATTERN = r"^v?\d+\.\d+(\.\d+)?$"
# A reported version: leading release numbers, then anything (e.g. "0.5.21-sim",
# "0.5.22rc1", "0.5.9.post2"). A pre-release of X is older than X.
_REPORTED = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.post\d+)?(.*)$")
_PRE = re.compile(r"^[.-]?(rc|dev|a|b|alpha|beta)\d*", re.IGNORECASE)

Severity = Literal["high", "medium", "low"]
# Findings kvproxy derives itself (not from the table); accepted by id like advisories.
BUILTIN_CHECKS: dict[str, tuple[Severity, str]] = {
    "kv-checksum-one-sided": (
        "high",
        "--disaggregation-enable-kv-checksum is on for one side of a prefill/decode pair "
        "only: the transferred KV is not verified (SGLang PR #39500 requires both sides)",
    ),
    "page-size-mismatch": (
        "high",
        "prefill and decode report different page sizes: their KV layouts do not match",
    ),
    "version-mismatch": ("medium", "prefill and decode run different engine versions"),
}
Version = tuple[int, int, int, int]  # major, minor, patch, 0 = release / -1 = pre-release


class AdvisoryError(ValueError):
    """The advisory table or an acceptance is invalid; the message names the entry."""


class Advisory(BaseModel):
    """One entry; the JSON schema in advisories.schema.json states the same rules."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{2,63}$")
    engine: Literal["sglang", "vllm"]
    introduced: str | None = Field(default=None, pattern=_VERSION_PATTERN)
    fixed_in: str = Field(pattern=_VERSION_PATTERN)
    transfer_backends: tuple[str, ...] | None = Field(default=None, min_length=1)
    when: dict[str, tuple[Any, ...]] = Field(default_factory=dict)
    effect: str = Field(min_length=10)
    severity: Severity
    source: str = Field(pattern=r"^https://")
    references: tuple[str, ...] = ()
    verification: str | None = None

    def affects_version(self, version: Version) -> bool:
        low = parse_version(self.introduced) if self.introduced else None
        high = parse_version(self.fixed_in)
        assert high is not None  # the field pattern guarantees it
        return (low is None or version >= low) and version < high

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_: Literal["kvproxy.advisories/1"] = Field(alias="schema")
    advisories: tuple[Advisory, ...]


def parse_version(text: str | None) -> Version | None:
    """(major, minor, patch, pre) of a reported version; None when it has no numbers."""
    if not isinstance(text, str):
        return None
    m = _REPORTED.match(text.strip())
    if m is None:
        return None
    pre = -1 if _PRE.match(m.group(4) or "") else 0
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), pre


def _load_file(path: Path) -> tuple[Advisory, ...]:
    try:
        raw = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise AdvisoryError(f"advisories file {path}: cannot read: {exc.strerror}") from None
    except orjson.JSONDecodeError as exc:
        raise AdvisoryError(f"advisories file {path}: not JSON: {exc}") from None
    try:
        return _Table.model_validate(raw).advisories
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise AdvisoryError(f"advisories file {path}: {where}: {first['msg']}") from None


@dataclass(frozen=True)
class AdvisoryTable:
    advisories: tuple[Advisory, ...]
    accepted: frozenset[str]
    files: tuple[str, ...]

    def by_id(self, advisory_id: str) -> Advisory | None:
        return next((a for a in self.advisories if a.id == advisory_id), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "files": list(self.files),
            "ids": [a.id for a in self.advisories],
            "accepted": sorted(self.accepted),
        }


def load_table(extra_file: str | None = None, accept: Iterable[str] = ()) -> AdvisoryTable:
    """The shipped table plus the operator's file; raise AdvisoryError on any problem."""
    files = [SHIPPED] + ([Path(extra_file)] if extra_file else [])
    entries: list[Advisory] = []
    for path in files:
        for adv in _load_file(path):
            if adv.id in BUILTIN_CHECKS or any(a.id == adv.id for a in entries):
                raise AdvisoryError(f"advisories file {path}: duplicate id {adv.id!r}")
            entries.append(adv)
    accepted = frozenset(accept)
    unknown = sorted(accepted - {a.id for a in entries} - set(BUILTIN_CHECKS))
    if unknown:
        raise AdvisoryError(f"accept_advisories names no advisory: {', '.join(unknown)}")
    return AdvisoryTable(tuple(entries), accepted, tuple(str(p) for p in files))
