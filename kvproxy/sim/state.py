"""The simulator's settings and ground truth: fixed config, run-time faults, counters.

Owns: ``EngineConfig`` (one engine, fixed at start; the three failure switches live here),
``Faults`` (knobs changed at run time through ``POST /sim/faults``) and ``EngineStats``
(the counters behind ``/sim/stats`` that the safety tests assert on).

Independent oracle: never imports kvproxy code outside ``kvproxy/sim``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvproxy.sim.limits import EngineError, Flavor

Role = Literal["prefill", "decode"]
# What the engines report as their SGLang version: the vulnerable mode's predates the
# pending-rejection fix (0.5.22); the fixed mode's is at or after every fix the incident
# names (0.5.22, and 0.5.23 for NIXL/MORI's failed-send-as-drained).
SIM_VERSION = "0.5.21-sim"
FIXED_SIM_VERSION = "0.5.23-sim"
# The vLLM flavour speaks v0.18+ (error texts) and reports this as its /version.
VLLM_SIM_VERSION = "0.30.0-sim"


@dataclass(frozen=True)
class EngineConfig:
    role: Role
    host: str = "127.0.0.1"
    port: int = 0
    flavor: Flavor = "sglang"
    context_length: int = 8192
    pool_tokens: int = 16384
    page_size: int = 16
    tokenizer: str | None = None
    model_name: str = "kvproxy-sim"
    seed: int = 0
    allow_auto_truncate: bool = False
    # SGLang speculative decoding, as the server arguments name it (None: off). Under EAGLE
    # the tokenizer manager reserves max(topk * steps, draft tokens) of the context.
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # SGLang decode context parallelism (--dcp-size): a sequence is sharded over the ranks,
    # so a request may hold pool x dcp tokens while max_total_num_tokens reports one rank.
    dcp_size: int = 1
    # vLLM data parallelism: dp_size engines behind one front end, each with pool_tokens.
    dp_size: int = 1
    # vLLM builds before PR #42206 export no kv_cache_size_tokens label.
    kv_cache_size_label: bool = True
    # The three failure modes; True means the engine behaves the vulnerable way.
    pending_rejection_transfers: bool = True
    free_on_abort: bool = True
    failed_send_as_drained: bool = True
    # Where a decode server finds prefill's bootstrap when the router sends port null.
    default_bootstrap_port: int = 8998
    bootstrap_timeout_s: float = 30.0
    # Posture, as /server_info reports it: the version string (None: SIM_VERSION), the
    # transfer backend, and SGLang's --disaggregation-enable-kv-checksum (kvproxy.sim.checksum).
    version: str | None = None
    transfer_backend: str = "mooncake"
    kv_checksum: bool = False


@dataclass
class Faults:
    """Run-time knobs; ``POST /sim/faults`` takes any subset of these names."""

    transfer_failure_probability: float = 0.0
    prefill_us_per_token: float = 40.0
    transfer_ms_per_page: float = 1.0
    decode_ms_per_token: float = 1.0
    # 0: the whole request is one batch (Mooncake's large default, the incident's setting).
    transfer_batch_pages: int = 0
    # SGLang's deferred-release timeout is 30 s (PR #35049).
    abort_ack_timeout_s: float = 30.0
    # How long decode waits for a transfer it was promised before giving the request up:
    # SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s by default. Without it a decode
    # whose prefill leg was cancelled mid-handshake would wait forever.
    waiting_timeout_s: float = 300.0

    def update(self, changes: dict[str, Any]) -> None:
        known = {f.name: f.type for f in fields(self)}
        for name, value in changes.items():
            if name not in known:
                raise EngineError(f"unknown fault {name!r}; known: {sorted(known)}")
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise EngineError(f"fault {name} must be a number >= 0")
            if name == "transfer_failure_probability" and value > 1:
                raise EngineError("transfer_failure_probability must be within [0, 1]")
        for name, value in changes.items():
            setattr(self, name, int(value) if name == "transfer_batch_pages" else float(value))


@dataclass
class EngineStats:
    requests_by_route: Counter[str] = field(default_factory=Counter)
    transfers_started: int = 0
    transfers_completed: int = 0
    transfer_failures: int = 0
    stale_page_reads: int = 0
    rejections_at_admission: int = 0
    pending_rejections: int = 0
    aborts: int = 0
    # Aborts that arrived while the request's transfer was still writing (decode held pages
    # and "transfer done" had not come): the incident's second race, whatever decode does next.
    aborts_before_drain: int = 0
    abort_acks: int = 0
    abort_ack_timeouts: int = 0
    # Transfers decode stopped waiting for (waiting_timeout_s): counted as failures too.
    waiting_timeouts: int = 0
    bootstrap_failures: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    # Transfers decode refused because the landed KV did not match prefill's digest.
    checksum_mismatches: int = 0
    # Requests whose max_new_tokens the scheduler silently lowered (SGLang's clamp).
    outputs_clamped: int = 0
