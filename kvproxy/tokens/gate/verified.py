"""The verified table: for which engines, versions and routers kvproxy's exact count may admit
a request, feature by feature. Data the gate executes, plus the lookup. Pure, no I/O.

kvproxy's exact chat count renders its replica of the engine's request normalisation
(`tokens.replica.chatnorm` + `tokens.replica.templates`). A gap in that replica
under-counts, so the exact count may admit a request only when *every* feature it uses
(`tokens.gate.features`) is listed here for the engine kind, the engine version and the
router between kvproxy and the engines; otherwise the request is decided by the guaranteed
bound alone (`TokenCounter`).

An entry is evidence, not opinion: each names the test that holds kvproxy's count equal to
an independent oracle of that engine's preprocessing (tests/oracles, written from the
engine's source at a pinned commit and sharing no code with kvproxy/) on fuzzed bodies that
use only the entry's features. A wrong entry makes that test fail.

Lookup rules (`verified_features`), each failing towards "unverified":
  * an engine version that is not a plain release (`0.5.9`, `0.5.9.post1`, `0.11.0+cu128`;
    not `0.5.10rc1`, `0.5.9.dev3`, a simulator's `-sim`), or that no probe reported, matches
    only entries for every version (`versions=None`);
  * an undetected router (`router_kind: auto` whose detection failed) matches only entries
    for every router (`routers=ALL_ROUTERS`);
  * several engines (a static pool, mixed kinds, engines on different versions): only the
    features verified for every one of them.

Must never: list a feature no oracle test covers, or widen an entry beyond the versions and
routers its oracle replicates.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvproxy.tokens.gate.features import FEATURES, Feature

RouterKind = Literal["none", "smg", "sglang-router", "vllm-router"]
ROUTER_KINDS: tuple[RouterKind, ...] = ("none", "smg", "sglang-router", "vllm-router")
ALL_ROUTERS: frozenset[RouterKind] = frozenset(ROUTER_KINDS)
EngineName = Literal["sglang", "vllm"]
# How the exact count is made: kvproxy's render of its normalisation replica, or the
# engine's own /tokenize rendering the client's chat fields (vLLM only, tokens.exact.engine).
Method = Literal["replica", "engine"]

Version = tuple[int, ...]
_RELEASE = re.compile(r"v?(\d+(?:\.\d+)*)(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")


def parse_version(text: str | None) -> Version | None:
    """A plain release's numbers, else None (unknown): pre-releases, dev builds and
    anything else unparseable match only the entries for every version."""
    if not isinstance(text, str):
        return None
    m = _RELEASE.fullmatch(text.strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


@dataclass(frozen=True, slots=True)
class Entry:
    """Features verified for `engine` ("*": both kinds) at versions `versions` (inclusive
    first and last release; None: every supported version) behind any of `routers`, for
    the counting `method`s listed."""

    engine: Literal["sglang", "vllm", "*"]
    versions: tuple[str, str] | None
    routers: frozenset[RouterKind]
    features: frozenset[Feature]
    evidence: str
    methods: frozenset[Method] = frozenset({"replica", "engine"})

    def matches(
        self, engine: EngineName, version: Version | None, router: RouterKind | None, method: Method
    ) -> bool:
        if self.engine not in ("*", engine) or method not in self.methods:
            return False
        if router is None:
            if self.routers != ALL_ROUTERS:
                return False
        elif router not in self.routers:
            return False
        if self.versions is None:
            return True
        if version is None:
            return False
        first, last = (_release(v) for v in self.versions)
        # Compared on the release's own length: 0.5.9 covers 0.5.9.post1's numbers (0,5,9).
        return first <= version[: len(first)] and version[: len(last)] <= last


def _release(text: str) -> Version:
    parsed = parse_version(text)
    if parsed is None:  # a table typo: caught by the table's own test at import
        raise ValueError(f"verified table: {text!r} is not a release version")
    return parsed


# --- the features --------------------------------------------------------------------------

# A plain chat: lowercase system/user/assistant turns with string content, ending on a user
# turn, no tools, no flags. Both engines hand these messages to transformers unchanged (vLLM
# wraps string content in a text part for "openai"-format templates, which the replica does
# too), and a JSON router forwards strings as they are.
PLAIN_CHAT: frozenset[Feature] = frozenset(
    {"route:chat", "role:system", "role:user", "role:assistant", "content:string"}
)
# Prompts that are strings or token ids: no normalisation at all, only the tokenizer and the
# special tokens it adds. Where tokenizer.json's post-processor and tokenizer_config.json
# disagree on those (DeepSeek-V3: the config asks for a BOS transformers 5 does not add),
# kvproxy counts the larger and calls the count an upper bound, not exact (tokens.exact.local).
PLAIN_PROMPTS: frozenset[Feature] = frozenset(
    {"route:completions", "prompt:text", "prompt:ids", "prompt:batch"}
)
# SGLang's own /generate route (vLLM has none): text or token ids, batched or not.
SGLANG_GENERATE: frozenset[Feature] = frozenset(
    {"route:generate", "generate:text", "generate:input_ids", "generate:batch"}
)

# The releases the oracles replicate (tests/oracles/versions.py).
SGLANG_ORACLE = "0.5.23"
VLLM_ORACLE = "0.34.0"

# Beyond a plain chat, on the release each oracle replicates (held by the fuzzer of
# tests/tokens/test_tokens_verified_oracles.py on one model of each shipped template family).
# What is left out was found to differ: on SGLang tool definitions (it dumps the whole tool
# object), add_generation_prompt false (SGLang always adds the prompt) and a final assistant
# turn; on vLLM tool turns and reasoning fields on some templates (GLM-4.7, MiniMax) and the
# developer role. Numbers beyond plain integers are never listed here: smg re-serialises them
# as float64 and orjson and json print floats differently.
SGLANG_CHAT: frozenset[Feature] = frozenset(
    {"add_generation_prompt:true", "kwarg:enable_thinking", "reasoning_effort",
     "message:name", "content:parts", "part:text", "content:null", "role:tool",
     "message:tool_call_id", "tool_calls", "tool_calls:args_string", "role:developer",
     "message:reasoning_content", "documents"}
)  # fmt: skip
VLLM_CHAT: frozenset[Feature] = frozenset(
    {"add_generation_prompt:true", "add_generation_prompt:false", "kwarg:enable_thinking",
     "reasoning_effort", "message:name", "content:parts", "part:text", "tools",
     "tool_choice", "final:assistant", "documents"}
)  # fmt: skip

# What vLLM's /tokenize renders itself from the client's own chat fields (messages, tools,
# chat_template_kwargs, add_generation_prompt, continue_final_message, add_special_tokens:
# vllm/entrypoints/serve/tokenize/protocol.py TokenizeChatRequest), with the same renderer
# as chat completions. Fields /tokenize does not take (documents, reasoning_effort,
# tool_choice, response_format, a request chat_template) and media stay unverified, and so
# do integers beyond 64 bits: kvproxy parses the body with orjson, which turns them into
# floats, so the fields it re-serialises for /tokenize would not carry the client's digits.
ENGINE_TRUTH_VLLM: frozenset[Feature] = frozenset(
    f
    for f in FEATURES
    if f == "route:chat"
    or f.startswith(("role:", "final:", "content:", "message:", "tool_calls", "tool:", "kwarg:"))
    or f in ("part:text", "part:string", "part:refusal", "tools", "tools:strict",
             "tools:defer_loading", "add_generation_prompt:true",
             "add_generation_prompt:false", "continue_final_message", "add_special_tokens",
             "number:float")
)  # fmt: skip


# --- the table -----------------------------------------------------------------------------

TABLE: tuple[Entry, ...] = (
    Entry(
        engine="*",
        versions=None,
        routers=ALL_ROUTERS,
        features=PLAIN_CHAT | PLAIN_PROMPTS,
        evidence="tests/tokens/test_tokens_verified_oracles.py: every oracle",
    ),
    Entry(
        engine="sglang",
        versions=None,
        routers=ALL_ROUTERS,
        features=SGLANG_GENERATE,
        evidence="tests/tokens/test_tokens_verified_oracles.py: the SGLang oracles",
    ),
    Entry(
        engine="sglang",
        versions=(SGLANG_ORACLE, SGLANG_ORACLE),
        routers=frozenset({"none", "smg"}),
        features=SGLANG_CHAT,
        evidence="tests/tokens/test_tokens_verified_oracles.py: oracles.sglang, oracles.smg",
    ),
    Entry(
        engine="vllm",
        versions=(VLLM_ORACLE, VLLM_ORACLE),
        routers=frozenset({"none"}),
        features=VLLM_CHAT,
        evidence="tests/tokens/test_tokens_verified_oracles.py: oracles.vllm",
    ),
    Entry(
        engine="vllm",
        versions=None,
        routers=frozenset({"none"}),
        features=ENGINE_TRUTH_VLLM,
        evidence="by construction: vLLM's /tokenize renders the client's chat fields "
        "(tests/tokens/test_tokens_engine.py::test_vllm_tokenize_gets_the_clients_fields)",
        methods=frozenset({"engine"}),
    ),
)


def verified_features(
    engines: Iterable[tuple[EngineName | Literal["static"], str | None]],
    router: RouterKind | None,
    method: Method = "replica",
    table: tuple[Entry, ...] = TABLE,
) -> frozenset[Feature]:
    """The features verified for every one of `engines` ((kind, reported version) pairs)
    behind `router` (None: not known). A static engine could be either kind, at any
    version: it counts as both kinds at an unknown version."""
    result: frozenset[Feature] | None = None
    for kind, version_text in engines:
        kinds: tuple[EngineName, ...] = ("sglang", "vllm") if kind == "static" else (kind,)
        version = None if kind == "static" else parse_version(version_text)
        for k in kinds:
            found = frozenset().union(
                *(e.features for e in table if e.matches(k, version, router, method))
            )
            result = found if result is None else result & found
    return result if result is not None else frozenset()


__all__ = [
    "ALL_ROUTERS",
    "ENGINE_TRUTH_VLLM",
    "PLAIN_CHAT",
    "PLAIN_PROMPTS",
    "ROUTER_KINDS",
    "SGLANG_CHAT",
    "SGLANG_GENERATE",
    "TABLE",
    "VLLM_CHAT",
    "Entry",
    "Method",
    "RouterKind",
    "parse_version",
    "verified_features",
]


# --- the runtime view ----------------------------------------------------------------------


class Verifier:
    """The verified feature sets of one model, for the engines and router last observed.

    Built at start from the configured engine kinds and `router_kind`; the capacity monitor
    feeds it each refresh's engine versions and, under `router_kind: auto`, the detected
    router (`observe`). The request path only reads a precomputed set (`unverified`)."""

    def __init__(
        self,
        engine_kinds: Iterable[EngineName | Literal["static"]],
        router_kind: RouterKind | Literal["auto"],
        table: tuple[Entry, ...] = TABLE,
    ) -> None:
        self._table = table
        self.router_setting = router_kind
        self.router: RouterKind | None = None if router_kind == "auto" else router_kind
        self.router_evidence = (
            "not detected yet" if router_kind == "auto" else "configured (router_kind)"
        )
        self.engines: tuple[tuple[EngineName | Literal["static"], str | None], ...] = tuple(
            (k, None) for k in engine_kinds
        )
        self._sets: dict[Method, frozenset[Feature]] = {}
        self._recompute()

    def observe(
        self,
        engines: Iterable[tuple[EngineName | Literal["static"], str | None]] | None = None,
        router: tuple[RouterKind | None, str] | None = None,
    ) -> bool:
        """New engine versions and/or a router detection (kind or None, and why); a router
        is taken only under `router_kind: auto`. Returns whether anything changed."""
        before = (self.engines, self.router)
        if engines is not None:
            self.engines = tuple(sorted(engines, key=lambda e: (e[0], e[1] or "")))
        if router is not None and self.router_setting == "auto":
            self.router, self.router_evidence = router
        changed = (self.engines, self.router) != before
        if changed:
            self._recompute()
        return changed

    def _recompute(self) -> None:
        engines = self.engines or (("static", None),)
        self._sets = {
            m: verified_features(engines, self.router, m, self._table)
            for m in ("replica", "engine")
        }

    def router_matters(self) -> bool:
        """Whether knowing the router could change what is verified for these engines at
        these versions: only then is the upstream asked (capacity.router). A static pool,
        or versions no row names, read the same rows behind any router."""
        engines = self.engines or (("static", None),)
        return any(
            verified_features(engines, r, m, self._table)
            != verified_features(engines, None, m, self._table)
            for r in ROUTER_KINDS
            for m in ("replica", "engine")
        )

    def verified(self, method: Method = "replica") -> frozenset[Feature]:
        return self._sets[method]

    def unverified(self, features: Iterable[Feature], method: Method = "replica") -> list[Feature]:
        """The request's features outside the verified set, sorted (empty: exact may admit)."""
        ok = self._sets[method]
        return sorted(f for f in features if f not in ok)

    def describe(self) -> str:
        """e.g. "sglang 0.5.9 behind smg": for error messages and the start-up log."""
        engines = ", ".join(sorted({f"{k} {v or 'version unknown'}" for k, v in self.engines}))
        router = self.router or "an undetected router"
        return f"{engines or 'no engine'} behind {router}"

    def to_json(self) -> dict[str, object]:
        return {
            "engines": [{"kind": k, "version": v} for k, v in self.engines],
            "router_kind": self.router,
            "router_setting": self.router_setting,
            "router_evidence": self.router_evidence,
            "verified_features": {m: sorted(s) for m, s in self._sets.items()},
        }


__all__ += ["Verifier"]
