"""One engine's posture, read from the report the capacity probe already fetched.

`/server_info` (SGLang) carries the server arguments flat next to `version`; older builds
lack fields, and a field that is absent is reported as not observable (None, and listed in
`absent`), never guessed. The engine's own failure counters come from its `/metrics`:
`sglang:num_transfer_failed_reqs_total` and `sglang:num_bootstrap_failed_reqs_total`
(incremented on a KV checksum mismatch too, SGLang PR #39500), summed over ranks.

Not observable from `/server_info` at all: SGLang's deferred decode KV release (#35049,
the `SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE` environment variable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Server argument names as SGLang's ServerArgs spells them (server_args.py); the checksum
# flag is `--disaggregation-enable-kv-checksum` (PR #39500).
FIELDS = (
    "version",
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "disaggregation_enable_kv_checksum",
    "allow_auto_truncate",
    "page_size",
)
FAILURE_COUNTERS = {
    "transfer": "sglang:num_transfer_failed_reqs_total",
    "bootstrap": "sglang:num_bootstrap_failed_reqs_total",
}
NOT_OBSERVABLE = ("deferred_decode_kv_release",)
_KINDS: dict[str, type] = {
    "disaggregation_enable_kv_checksum": bool,
    "allow_auto_truncate": bool,
    "page_size": int,
}


@dataclass(frozen=True)
class EnginePosture:
    version: str | None
    mode: str | None
    transfer_backend: str | None
    kv_checksum: bool | None
    allow_auto_truncate: bool | None
    page_size: int | None
    server_args: Mapping[str, Any]
    failures: Mapping[str, float]  # kind -> the engine's counter; absent: not exported
    absent: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "disaggregation_mode": self.mode,
            "transfer_backend": self.transfer_backend,
            "kv_checksum": _state(self.kv_checksum),
            "allow_auto_truncate": self.allow_auto_truncate,
            "page_size": self.page_size,
            "failures": dict(self.failures),
            "not_observable": list(self.absent) + list(NOT_OBSERVABLE),
        }


def _state(flag: bool | None) -> str:
    return "not observable" if flag is None else ("on" if flag else "off")


def _typed(info: Mapping[str, Any], key: str, kind: type) -> Any:
    value = info.get(key)
    if kind is int and isinstance(value, bool):
        return None
    return value if isinstance(value, kind) else None


def read_posture(
    server_info: Mapping[str, Any],
    counters: Mapping[str, Sequence[tuple[Mapping[str, str], float]]] | None,
) -> EnginePosture:
    """The posture fields of one SGLang `/server_info` answer and the samples of its
    `FAILURE_COUNTERS` in `/metrics` (None: no metrics were read; the capacity probe parses
    the exposition it already fetched)."""
    args = {k: server_info[k] for k in FIELDS if k in server_info}
    absent = [k for k in FIELDS if _typed(server_info, k, _KINDS.get(k, str)) is None]
    failures: dict[str, float] = {}
    if counters is not None:
        samples = counters
        for kind, name in FAILURE_COUNTERS.items():
            values = samples.get(name) or []
            if values:
                failures[kind] = sum(v for _, v in values)
    for kind, name in FAILURE_COUNTERS.items():
        if kind not in failures:
            absent.append(f"metrics.{name}")
    return EnginePosture(
        version=_typed(server_info, "version", str),
        mode=_typed(server_info, "disaggregation_mode", str),
        transfer_backend=_typed(server_info, "disaggregation_transfer_backend", str),
        kv_checksum=_typed(server_info, "disaggregation_enable_kv_checksum", bool),
        allow_auto_truncate=_typed(server_info, "allow_auto_truncate", bool),
        page_size=_typed(server_info, "page_size", int),
        server_args=args,
        failures=failures,
        absent=tuple(absent),
    )
