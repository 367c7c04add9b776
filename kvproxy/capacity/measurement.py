"""What one probe of one engine found, and how a probe fails.

Owns `EngineMeasurement` (the numbers an engine reported, each with the field it came
from) and `ProbeError` (a failed probe with a short, bounded `reason` label used in
`kvproxy_capacity_probe_errors_total{engine,reason}`).

Must never: hold a number without saying where it came from, or carry response bodies
(an HTML error page is described by its type and size, never quoted at length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvproxy.posture import EnginePosture

Role = Literal["prefill", "decode", "unified"]
Kind = Literal["sglang", "vllm", "static"]
Source = Literal["measured", "declared"]
# What bounds an engine's input limit: its KV pool, its context length, or a declared number.
BoundBy = Literal["pool", "context", "declared"]

# The closed set of probe failure labels (metric label values stay bounded).
PROBE_ERROR_REASONS = (
    "connect",  # TCP connect refused / reset / unreachable
    "dns",  # the engine's host name did not resolve
    "timeout",  # no complete answer within the per-engine timeout
    "http_status",  # a non-2xx status on a required endpoint
    "not_json",  # a JSON endpoint answered with HTML or malformed JSON
    "not_metrics",  # /metrics answered with something that is not Prometheus text
    "missing_field",  # a required field is absent in every place it may live
    "bad_type",  # a field has the wrong type (string, bool, float where an int belongs)
    "bad_value",  # a field has a value no engine would report (zero, negative, "None")
    "too_large",  # the response exceeded the size cap
    "protocol",  # the connection broke mid-response or the HTTP was malformed
)

# Warning labels a measurement may carry; each is also explained in `notes`.
WARNING_LABELS = (
    "allow_auto_truncate",  # SGLang would silently cut over-long prompts
    "context_exceeds_pool",  # the engine's context is larger than its KV pool (the incident)
    "dp_ranks_differ",  # data-parallel ranks report different pools; the smallest is used
    "fields_disagree",  # two reports of one number differ; the smaller is used
    "swa_pool_binds",  # the sliding-window pool is smaller than the full pool and is used
    "pool_from_blocks",  # vLLM pool = num_gpu_blocks x block_size (can overstate on hybrids)
)


@dataclass
class Findings:
    """Warnings and notes gathered while reading one engine's reports.

    A warning is a label from WARNING_LABELS plus a note `"<label>: <why>"`; a plain note
    is context for humans (/capacity) with no alerting meaning.
    """

    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def warn(self, label: str, note: str) -> None:
        if label not in WARNING_LABELS:
            raise ValueError(f"unknown warning label {label!r}")
        if label not in self.warnings:
            self.warnings.append(label)
        self.notes.append(f"{label}: {note}")

    def note(self, text: str) -> None:
        self.notes.append(text)


class ProbeError(Exception):
    """A probe could not establish the engine's limit; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in PROBE_ERROR_REASONS:
            raise ValueError(f"unknown probe error reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


@dataclass(frozen=True)
class EngineMeasurement:
    """One engine's runtime-reported capacity. Token counts are inclusive limits.

    `input_limit_tokens` is the largest prompt the engine accepts; `decode_limit_tokens`
    the largest prompt + output it holds. Every number names its source field, e.g.
    `"server_info.max_req_input_len"` or `"metrics.vllm:cache_config_info.kv_cache_size_tokens"`.
    """

    engine: str
    url: str
    role: Role
    kind: Kind
    input_limit_tokens: int
    input_limit_source: str
    pool_tokens: int
    pool_source: str
    bound_by: BoundBy
    measured_at: float  # unix time, for humans and the last-success gauge
    page_size: int | None = None
    page_size_source: str | None = None
    context_length: int | None = None
    context_source: str | None = None
    decode_limit_tokens: int | None = None
    decode_limit_source: str | None = None
    # Largest prompt + output the engine's front end accepts; a prefill engine adds it to
    # the decode limit (its tokenizer checks the same body).
    request_limit_tokens: int | None = None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # Which report fields this probe found and which it looked for in vain: /capacity
    # shows both, so an absent field is never mistaken for a check that happened.
    fields_present: tuple[str, ...] = ()
    fields_absent: tuple[str, ...] = ()
    # Version, transfer backend, KV checksum, failure counters (kvproxy.posture); None for
    # engines whose reports carry none of it.
    posture: EnginePosture | None = None
    # The engine's own version string (SGLang `/server_info` `version`, vLLM `/version`):
    # the verified-feature table is read for it (kvproxy.tokens.gate.verified). None: not reported.
    version: str | None = None

    @property
    def source(self) -> Source:
        """`declared` for static engines, whose number no engine reported."""
        return "declared" if self.kind == "static" else "measured"

    def warning_note(self, label: str) -> str:
        """The note that explains warning `label` (the label itself if none does)."""
        prefix = f"{label}: "
        return next((n[len(prefix) :] for n in self.notes if n.startswith(prefix)), label)

    def limit_phrase(self) -> str:
        """Human phrase naming what bounds this engine, used in rejection messages."""
        if self.bound_by == "declared":
            return f"declared {self.role} capacity of {self.engine}"
        what = "KV pool" if self.bound_by == "pool" else "context length"
        return f"measured {self.role} {what} of {self.engine}"

    def to_json(self) -> dict[str, Any]:
        return {
            "input_limit_tokens": self.input_limit_tokens,
            "pool_tokens": self.pool_tokens,
            "page_size": self.page_size,
            "context_length": self.context_length,
            "decode_limit_tokens": self.decode_limit_tokens,
            "request_limit_tokens": self.request_limit_tokens,
            "bound_by": self.bound_by,
            "source": self.source,
            "sources": {
                "input_limit_tokens": self.input_limit_source,
                "pool_tokens": self.pool_source,
                "page_size": self.page_size_source,
                "context_length": self.context_source,
                "decode_limit_tokens": self.decode_limit_source,
            },
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "fields": {"present": list(self.fields_present), "absent": list(self.fields_absent)},
            "posture": self.posture.to_json() if self.posture is not None else None,
            "version": self.version,
            "measured_at": self.measured_at,
        }
