"""The SGLang server arguments the limit arithmetic reads from `/server_info`.

`/server_info` is the server arguments plus scheduler facts, so the settings that move an
engine's limits are there: the speculative algorithm and its draft sizes (a context
reserve), and the decode-context-parallel size (a pool multiplier). This module turns them
into two numbers, each with the field it came from, and records which fields were present
and which were looked for in vain, so `/capacity` never presents an absent field as a
check that happened.

The rules, with the SGLang source each follows (python/sglang/srt):
- reserve: `managers/tokenizer_manager.py` sets `num_reserved_tokens` to
  `max(speculative_eagle_topk * speculative_num_steps, speculative_num_draft_tokens)` when
  `SpeculativeAlgorithm.is_eagle()` (EAGLE, EAGLE3, NEXTN and plugin algorithms that declare
  themselves EAGLE-like), else 0; newer builds (`managers/utils.py
  compute_num_reserved_tokens`) also take `max_speculative_num_draft_tokens` into the max.
  NGRAM is never EAGLE-like. Any other name gets the EAGLE reserve: a plugin may declare
  itself EAGLE-like, and reserving when the engine does not only under-admits.
- a speculative algorithm that is on with its sizes missing or unreadable gives no limit
  (ProbeError): the reserve could be anything up to the context.
- DCP: `--dcp-size` is `server_args.dcp_size` (the parallel state calls it
  `attn_dcp_size`); both names are read, and the smaller wins.

Must never: guess a reserve of 0 for an algorithm that reserves, or read a DCP size that
is not a positive integer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvproxy.capacity.measurement import ProbeError
from kvproxy.capacity.reports import token_field

_OFF = ("", "NONE", "NULL")
_NO_RESERVE = ("NGRAM",)
_SIZES = ("speculative_eagle_topk", "speculative_num_steps", "speculative_num_draft_tokens")
_DCP_FIELDS = ("dcp_size", "attn_dcp_size")


@dataclass
class ServerArgs:
    reserved_tokens: int = 0
    reserve_source: str = "no speculative decoding"
    dcp_size: int = 1
    dcp_source: str | None = None
    present: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)

    def saw(self, obj: Mapping[str, Any], key: str, where: str) -> bool:
        """Record whether `key` was reported (null counts as not reported)."""
        if obj.get(key) is None:
            self.absent.append(where)
            return False
        self.present.append(where)
        return True


def _reserve(info: Mapping[str, Any], p: str, args: ServerArgs) -> None:
    if not args.saw(info, "speculative_algorithm", f"{p}.speculative_algorithm"):
        args.reserve_source = f"{p}.speculative_algorithm not reported: no reserve"
        return
    algorithm = info["speculative_algorithm"]
    if not isinstance(algorithm, str):
        raise ProbeError(
            "bad_type", f"{p}.speculative_algorithm is {type(algorithm).__name__}, expected text"
        )
    name = algorithm.strip().upper()
    if name in _OFF:
        return
    if name in _NO_RESERVE:
        args.reserve_source = f"{p}.speculative_algorithm {algorithm!r} reserves nothing"
        return
    sizes: dict[str, int | None] = {}
    for key in (*_SIZES, "max_speculative_num_draft_tokens"):
        where = f"{p}.{key}"
        args.saw(info, key, where)
        try:
            sizes[key] = token_field(info, key, where)
        except ProbeError as exc:
            raise ProbeError(
                exc.reason,
                f"{exc.message}; speculative_algorithm {algorithm!r} reserves context for its "
                "draft tokens, so no limit is derived without it",
            ) from None
    missing = [k for k in _SIZES if sizes[k] is None]
    if missing:
        raise ProbeError(
            "missing_field",
            f"speculative_algorithm {algorithm!r} is on but {', '.join(missing)} "
            "not reported: SGLang reserves max(topk x steps, draft tokens) of the context "
            "for it (tokenizer_manager num_reserved_tokens), so no limit is derived",
        )
    topk, steps, drafts = (int(sizes[k] or 0) for k in _SIZES)
    extra = sizes["max_speculative_num_draft_tokens"] or 0
    args.reserved_tokens = max(topk * steps, drafts, extra)
    args.reserve_source = (
        f"{algorithm} reserve max({p}.speculative_eagle_topk x speculative_num_steps = "
        f"{topk * steps}, speculative_num_draft_tokens = {drafts}"
        + (f", max_speculative_num_draft_tokens = {extra}" if extra else "")
        + f") = {args.reserved_tokens}"
    )


def _dcp(info: Mapping[str, Any], p: str, args: ServerArgs) -> None:
    sizes: list[tuple[int, str]] = []
    for key in _DCP_FIELDS:
        where = f"{p}.{key}"
        if args.saw(info, key, where):
            value = token_field(info, key, where)
            if value is not None:
                sizes.append((value, where))
    if sizes:
        args.dcp_size, args.dcp_source = min(sizes)


def read_server_args(info: Mapping[str, Any], path: str) -> ServerArgs:
    """The reserve and DCP size `info` reports; ProbeError when they cannot be known."""
    args = ServerArgs()
    _reserve(info, path, args)
    _dcp(info, path, args)
    return args
