"""The runtime canary tripwire: foreign tenants' markers in a response mean a KV leak.

Owns compiling the configured markers (`KVPROXY_CANARIES`: per tenant, literal strings and
bounded regular expressions) into one combined regex per requesting tenant, and scanning
response text for the markers of every *other* tenant. A request whose tenant is unknown,
or has no markers of its own, treats every registered marker as foreign.

Scanning is incremental: `CanaryScanner.feed_text(index, text)` keeps, per choice index, a
tail of (longest marker - 1) characters so a marker split across chunks matches at every
offset, and each call searches at most `len(text) + tail` characters, so the cost per chunk
does not grow with the response. `scan_body` does the same for a whole non-streamed body.

Why not one big alternation regex: Python's `re` tries every alternative at every position,
so the cost grows with the number of markers (measured: ~35 us per 6-character chunk at 20
tenants, ~560 us at 100). Instead every marker with a literal prefix of >= 3 characters
(all literal markers, and patterns such as `KVCANARY-acme-[0-9a-f]{16}`) is found through
one search for the distinct 3-character keys of those prefixes, and only the markers behind
a key that occurs are checked there; ordinary text rarely contains a key, so a chunk costs
about one C-level search. Patterns without such a prefix share one combined regex.
Patterns should not rely on lookaround at their edges: text is seen through a window.

What a hit carries: the owner tenant and a stable marker id (`<tenant>#<n>`, n counting the
tenant's literal markers first, then its patterns, from 1), never the matched text or the
text around it (I8). The relay counts `kvproxy_canary_violations_total{tenant}` and, with
`canary_action: block`, cuts the stream or replaces the body with a 502.

Must never: do I/O, log, or hold more than one tail per choice index. A pattern that can
match unboundedly long text (or empty text) is refused at start: the tail must be bounded.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kvproxy.config import CanaryTenant, ConfigError, Settings
from kvproxy.sse import body_texts
from kvproxy.tenants import sanitize_tenant

# Longest text one marker may match: the per-index tail is this minus one.
MAX_MARKER_CHARS = 1024
# Shorter markers would fire on ordinary text and, with action=block, cut real replies.
MIN_MARKER_CHARS = 8
# Hits kept per scanner for reporting (the count goes on beyond this).
MAX_KEPT_HITS = 16
_GROUP_PREFIX = "_kvc"
# Numbered backreferences change meaning once patterns are combined into one regex.
_BACKREF = re.compile(r"\\(?:[1-9]|g<)|\(\?P=|\(\?\(")
# Characters of literal prefix that key the prefilter search.
KEY_CHARS = 3
# Typeshed has no stubs for re's parser; it is the only way to know a pattern's width and
# literal prefix.
_re_parser: Any = importlib.import_module("re._parser")
_LITERAL: Any = importlib.import_module("re._constants").LITERAL

CanaryAction = Literal["block", "observe"]


@dataclass(frozen=True, slots=True)
class CanaryHit:
    """A foreign marker was seen: whose it is and which one. Never the text."""

    owner_tenant: str
    marker_id: str


@dataclass(frozen=True, slots=True)
class _Marker:
    owner: str
    marker_id: str
    source: str  # regex source, literals escaped
    max_chars: int
    prefix: str  # literal text every match starts with (may be empty)
    literal: bool  # the whole marker is `prefix`


@dataclass(frozen=True, slots=True)
class _Anchored:
    marker: _Marker
    regex: re.Pattern[str] | None  # None for literal markers: `startswith` suffices


@dataclass(frozen=True, slots=True)
class _Compiled:
    keys: re.Pattern[str] | None  # finds the KEY_CHARS-long key of an anchored marker
    by_key: dict[str, tuple[_Anchored, ...]]
    loose: re.Pattern[str] | None  # markers without a literal prefix, combined
    loose_by_group: dict[str, _Marker]
    tail_chars: int


class CanaryScanner:
    """Scans one response for foreign markers. One per response; not thread-safe."""

    __slots__ = ("_compiled", "_tails", "hit_count", "hits", "tenant")

    def __init__(self, compiled: _Compiled | None, tenant: str | None) -> None:
        self._compiled = compiled
        self.tenant = tenant
        self._tails: dict[int, str] = {}
        self.hits: list[CanaryHit] = []
        self.hit_count = 0

    @property
    def active(self) -> bool:
        """False when there is no foreign marker to look for."""
        return self._compiled is not None

    def feed_text(self, index: int, text: str) -> CanaryHit | None:
        """Scan the next piece of generated text of choice `index`; the first hit in it."""
        compiled = self._compiled
        if compiled is None or not text:
            return None
        tail = self._tails.get(index)
        window = tail + text if tail else text
        first, end = self._search(compiled, window)
        keep_from = max(end, len(window) - compiled.tail_chars)
        self._tails[index] = window[keep_from:] if compiled.tail_chars else ""
        return first

    def scan_body(self, body: bytes) -> CanaryHit | None:
        """Scan a whole non-streamed body (each generated string on its own)."""
        compiled = self._compiled
        if compiled is None:
            return None
        first: CanaryHit | None = None
        for text in body_texts(body):
            hit, _ = self._search(compiled, text)
            first = first or hit
        return first

    def _search(self, compiled: _Compiled, text: str) -> tuple[CanaryHit | None, int]:
        """Every non-overlapping marker match in `text`, leftmost first; returns the first
        hit and where the last one ended."""
        found = _find(compiled, text)
        first: CanaryHit | None = None
        end = 0
        for start, stop, marker in found:
            if start < end:
                continue  # overlaps a match already counted
            hit = CanaryHit(owner_tenant=marker.owner, marker_id=marker.marker_id)
            self.hit_count += 1
            if len(self.hits) < MAX_KEPT_HITS:
                self.hits.append(hit)
            first = first or hit
            end = stop
        return first, end


def _find(compiled: _Compiled, text: str) -> list[tuple[int, int, _Marker]]:
    found: list[tuple[int, int, _Marker]] = []
    if compiled.keys is not None:
        search = compiled.keys.search
        m = search(text)
        while m is not None:
            pos = m.start()
            for cand in compiled.by_key[m.group()]:
                prefix = cand.marker.prefix
                if not text.startswith(prefix, pos):
                    continue
                if cand.regex is None:
                    found.append((pos, pos + len(prefix), cand.marker))
                elif (full := cand.regex.match(text, pos)) is not None:
                    found.append((pos, full.end(), cand.marker))
            # From pos + 1, not m.end(): keys of different markers may overlap.
            m = search(text, pos + 1)
    if compiled.loose is not None:
        for m in compiled.loose.finditer(text):
            found.append((m.start(), m.end(), compiled.loose_by_group[m.lastgroup or ""]))
    if len(found) > 1:
        found.sort(key=lambda f: f[0])  # stable: keeps marker order at equal starts
    return found


class CanaryRules:
    """Every tenant's markers, compiled once at start."""

    def __init__(self, markers: Iterable[_Marker], action: CanaryAction = "block") -> None:
        self.action: CanaryAction = action
        self._markers = tuple(markers)
        self.tenants = tuple(dict.fromkeys(m.owner for m in self._markers))
        self._everyone = _compile(self._markers)
        self._per_tenant = {
            t: _compile([m for m in self._markers if m.owner != t]) for t in self.tenants
        }

    @classmethod
    def from_settings(cls, settings: Settings) -> CanaryRules:
        return cls.from_tenants(settings.canaries, settings.canary_action)

    @classmethod
    def from_tenants(
        cls, tenants: Iterable[CanaryTenant], action: CanaryAction = "block"
    ) -> CanaryRules:
        """Raises ConfigError (one line, naming the tenant and marker id) on a bad marker."""
        markers: list[_Marker] = []
        seen: dict[str, int] = {}
        for entry in tenants:
            owner = sanitize_tenant(entry.tenant)
            if owner is None:
                raise ConfigError("canaries: a tenant id is blank")
            n = seen.get(owner, 0)
            for literal in entry.markers:
                n += 1
                markers.append(_literal(owner, f"{owner}#{n}", literal))
            for pattern in entry.patterns:
                n += 1
                markers.append(_pattern(owner, f"{owner}#{n}", pattern))
            seen[owner] = n
        return cls(markers, action)

    @property
    def active(self) -> bool:
        """Any marker registered at all (else the relay can skip scanning)."""
        return bool(self._markers)

    @property
    def marker_ids(self) -> tuple[str, ...]:
        return tuple(m.marker_id for m in self._markers)

    def scanner(self, tenant: str | None) -> CanaryScanner:
        """A scanner for one response to `tenant` (None: unknown, every marker is foreign)."""
        if tenant is not None and tenant in self._per_tenant:
            return CanaryScanner(self._per_tenant[tenant], tenant)
        return CanaryScanner(self._everyone, tenant)


def _literal(owner: str, marker_id: str, literal: str) -> _Marker:
    if len(literal) < MIN_MARKER_CHARS or len(literal) > MAX_MARKER_CHARS:
        raise ConfigError(
            f"canaries: marker {marker_id} must be {MIN_MARKER_CHARS}-{MAX_MARKER_CHARS} "
            f"characters long (got {len(literal)})"
        )
    return _Marker(owner, marker_id, re.escape(literal), len(literal), literal, literal=True)


def _pattern(owner: str, marker_id: str, pattern: str) -> _Marker:
    where = f"canaries: pattern {marker_id}"
    if _BACKREF.search(pattern) or f"(?P<{_GROUP_PREFIX}" in pattern:
        raise ConfigError(f"{where}: backreferences and conditionals are not supported")
    try:
        # Wrapped as it will be in the combined regex: catches global flags like (?i)
        # that are only legal at the very start (use the scoped form (?i:...) instead).
        re.compile(f"(?:{pattern})")
        parsed = _re_parser.parse(pattern)
        lo, hi = parsed.getwidth()
    except re.error as exc:
        raise ConfigError(f"{where} is not a valid regular expression: {exc}") from None
    if hi > MAX_MARKER_CHARS:
        raise ConfigError(
            f"{where} can match unboundedly long text (longest match must be <= "
            f"{MAX_MARKER_CHARS} characters: use {{m,n}} instead of * or +)"
        )
    if lo < MIN_MARKER_CHARS:
        raise ConfigError(
            f"{where} can match text shorter than {MIN_MARKER_CHARS} characters "
            f"(shortest match {lo}); it would fire on ordinary replies"
        )
    return _Marker(owner, marker_id, pattern, int(hi), _literal_prefix(parsed), literal=False)


def _literal_prefix(parsed: Any) -> str:
    """The literal characters every match of a parsed pattern starts with."""
    if parsed.state.flags & re.IGNORECASE:
        return ""
    out = []
    for op, av in parsed.data:
        if op is not _LITERAL:
            break
        out.append(chr(av))
    return "".join(out)


def _compile(markers: Iterable[_Marker]) -> _Compiled | None:
    markers = list(markers)
    if not markers:
        return None
    by_key: dict[str, list[_Anchored]] = {}
    loose: dict[str, _Marker] = {}
    for i, m in enumerate(markers):
        if len(m.prefix) >= KEY_CHARS:
            regex = None if m.literal else re.compile(m.source)
            by_key.setdefault(m.prefix[:KEY_CHARS], []).append(_Anchored(m, regex))
        else:
            loose[f"{_GROUP_PREFIX}{i}"] = m
    keys = "|".join(re.escape(k) for k in sorted(by_key))
    # The wrapper group closes after any group inside a pattern, so `lastgroup` names it.
    loose_source = "|".join(f"(?P<{g}>{m.source})" for g, m in loose.items())
    return _Compiled(
        keys=re.compile(keys) if by_key else None,
        by_key={k: tuple(v) for k, v in by_key.items()},
        loose=re.compile(loose_source) if loose else None,
        loose_by_group=loose,
        tail_chars=max(m.max_chars for m in markers) - 1,
    )
