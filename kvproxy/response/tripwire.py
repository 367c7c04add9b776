"""The runtime canary tripwire: foreign tenants' markers in a response mean a KV leak.

Owns compiling the configured markers (`KVPROXY_CANARIES`: per tenant, literal strings and
bounded regular expressions) into one combined regex per requesting tenant, and scanning
response text for the markers of every *other* tenant. A request whose tenant is unknown,
or has no markers of its own, treats every registered marker as foreign.

What is scanned: every string the client receives, as `kvproxy.response.payload` reads it from
each event and body (values at any depth and object keys, JSON escapes resolved, raw text
when it is not JSON), whatever key it sits under. Scanning is incremental:
`CanaryScanner.feed(paths, texts)` keeps, per path (per choice and per field), a tail of
(longest marker - 1) characters so a marker split across events matches at every offset,
and each string costs at most `len(text) + tail` characters of search, so the cost per
event does not grow with the response. `scan_body` does the same for a whole body.

Two prefilters, both exact rather than heuristic:
- on raw bytes (`CanaryScanner.skips`): every match starts with its marker's first
  character (a literal's, or a pattern's literal prefix; a pattern without one turns this
  filter off). Decoding an event without a backslash (no JSON escape) only ever yields
  characters its bytes hold, plus the separators the reading adds (NUL, newline) and
  U+FFFD for invalid UTF-8, which no start character may be. So an event whose bytes hold
  no backslash and no start character, while no path's kept tail holds one either, cannot
  hold any part of a marker: a marker split over events starts in a tail or in this event.
  Skipping it leaves the tails free of start characters, so the argument carries on to
  the next event; a tail that did not see the skipped text can only lose context a match
  never uses (markers have no lookaround, `_looks_past_match`). A skipped event also keeps
  the previous string of its path: that only narrows the repeat that is not counted twice.
- on decoded text (`_feed`): the windows (tail + string) of one event are joined and
  searched once for any key; only an event where one occurs is searched window by
  window. A match inside a window is a match inside the joined text.

Why not one big alternation regex: Python's `re` tries every alternative at every position,
so the cost grows with the number of markers (measured: ~35 us per 6-character chunk at 20
tenants, ~560 us at 100). Instead every marker with a literal prefix of >= 3 characters
(all literal markers, and patterns such as `KVCANARY-acme-[0-9a-f]{16}`) is found through
one search for the distinct 3-character keys of those prefixes, and only the markers behind
a key that occurs are checked there; ordinary text rarely contains a key, so a chunk costs
about one C-level search. Patterns without such a prefix share one combined regex.
Patterns with anchors or lookaround are refused: text is seen through windows.

What a hit carries: the owner tenant and a stable marker id (`<tenant>#<n>`, n counting the
tenant's literal markers first, then its patterns, from 1), never the matched text or the
text around it (I8). The relay counts `kvproxy_canary_violations_total{tenant}` and, with
`canary_action: block`, cuts the stream or replaces the body with a 502.

Must never: do I/O, log, or hold more than one tail and one previous string per path. A
pattern that can match unboundedly long text (or empty text) is refused at start: the tail
must be bounded.
"""

from __future__ import annotations

import importlib
import operator
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from kvproxy.policy import ConfigError, record, sanitize_tenant
from kvproxy.response.payload import SEP, read_body

if TYPE_CHECKING:
    from kvproxy.config import CanaryTenant, Settings

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
# Characters a reading of an event can produce that its bytes need not hold: the empty
# "first character" of a marker without a literal prefix, the separators `output` joins
# keys and data lines with, and the replacement of invalid UTF-8. A marker starting with
# one of them turns the raw-bytes prefilter off.
_ADDED_BY_READING = frozenset({"", "\x00", "\n", "\ufffd"})
# Typeshed has no stubs for re's parser; it is the only way to know a pattern's width and
# literal prefix.
_re_parser: Any = importlib.import_module("re._parser")
_constants: Any = importlib.import_module("re._constants")
_LITERAL: Any = _constants.LITERAL
# ^ $ \b \A \Z and lookaround: they look past the match, and the scanner sees text through
# windows (a tail, one string of an event), so their answer would depend on the framing.
_EDGE_OPS: tuple[Any, ...] = (_constants.AT, _constants.ASSERT, _constants.ASSERT_NOT)

CanaryAction = Literal["block", "observe"]


@record
class CanaryHit:
    """A foreign marker was seen: whose it is and which one. Never the text."""

    owner_tenant: str
    marker_id: str


@record
class _Marker:
    owner: str
    marker_id: str
    source: str  # regex source, literals escaped
    max_chars: int
    prefix: str  # literal text every match starts with (may be empty)
    literal: bool  # the whole marker is `prefix`


@record
class _Anchored:
    marker: _Marker
    regex: re.Pattern[str] | None  # None for literal markers: `startswith` suffices


@record
class _Compiled:
    keys: re.Pattern[str] | None  # finds the KEY_CHARS-long key of an anchored marker
    by_key: dict[str, tuple[_Anchored, ...]]
    loose: re.Pattern[str] | None  # markers without a literal prefix, combined
    loose_by_group: dict[str, _Marker]
    tail_chars: int
    # The first character of every marker (`skips`), as text and as UTF-8; None when one
    # has no literal first character or its first character is one a reading adds.
    starts: re.Pattern[str] | None
    starts_utf8: re.Pattern[bytes] | None


class _Streams:
    """The rolling tail and the previous string of every path of one response.

    The paths of consecutive events are nearly always the same list (one token delta
    after another), so the state of the last event's paths is kept as two lists aligned
    with them (`paths`, `tails`, `prevs`) and a whole event is handled with list-wide
    operations; only when the paths change does the state go through the per-path dicts.
    """

    __slots__ = ("clean", "cold_prevs", "cold_tails", "paths", "prevs", "tails")

    def __init__(self) -> None:
        self.paths: list[str] | None = None
        self.tails: list[str] = []
        self.prevs: list[str] = []
        self.cold_tails: dict[str, str] = {}
        self.cold_prevs: dict[str, str] = {}
        # Whether no tail holds a start character (`CanaryScanner.skips`); None: not known
        # since the tails last changed.
        self.clean: bool | None = True

    def load(self, paths: list[str]) -> tuple[list[str], list[str]]:
        if paths == self.paths:
            return self.tails, self.prevs
        if self.paths is not None:
            self.cold_tails.update(zip(self.paths, self.tails, strict=True))
            self.cold_prevs.update(zip(self.paths, self.prevs, strict=True))
        tails, prevs = self.cold_tails, self.cold_prevs
        return [tails.get(p, "") for p in paths], [prevs.get(p, "") for p in paths]

    def store(self, paths: list[str], tails: list[str], prevs: list[str]) -> None:
        self.paths, self.tails, self.prevs = paths, tails, prevs
        self.clean = None

    def tails_clean(self, starts: re.Pattern[str]) -> bool:
        if self.clean is None:
            self.clean = starts.search("\x00".join(self.tails)) is None and not any(
                starts.search(t) for t in self.cold_tails.values()
            )
        return self.clean

    def tail(self, path: str) -> str:
        if self.paths is not None and path in self.paths:
            return self.tails[self.paths.index(path)]
        return self.cold_tails.get(path, "")


class CanaryScanner:
    """Scans one response for foreign markers. One per response; not thread-safe."""

    __slots__ = ("_compiled", "_streams", "hit_count", "hits", "tenant")

    def __init__(self, compiled: _Compiled | None, tenant: str | None) -> None:
        self._compiled = compiled
        self.tenant = tenant
        self._streams = _Streams()
        self.hits: list[CanaryHit] = []
        self.hit_count = 0

    @property
    def active(self) -> bool:
        """False when there is no foreign marker to look for."""
        return self._compiled is not None

    def feed(self, paths: list[str], texts: list[str]) -> CanaryHit | None:
        """Scan one event's strings, each continuing the text seen before at its path
        (`kvproxy.response.payload.Reading`); the first new hit."""
        compiled = self._compiled
        if compiled is None or not texts:
            return None
        return self._feed(compiled, self._streams, paths, texts)

    def skips(self, payload: bytes) -> bool:
        """Whether one event's raw bytes provably hold no part of any marker, so `feed`
        of its strings can be left out (the module docstring says why this is exact)."""
        compiled = self._compiled
        if compiled is None:
            return True
        starts = compiled.starts
        return (
            starts is not None
            and _holds_no_start(compiled, payload)
            and self._streams.tails_clean(starts)
        )

    def feed_text(self, index: int, text: str) -> CanaryHit | None:
        """Scan the next piece of text of choice `index` (one path per index)."""
        return self.feed([f"{SEP}#{index}"], [text])

    def scan_body(self, body: bytes) -> CanaryHit | None:
        """Scan a whole non-streamed body: every string in it (`output.read_body`)."""
        compiled = self._compiled
        if compiled is None or _holds_no_start(compiled, body):
            return None  # a body starts with no tail: its bytes alone decide (`skips`)
        streams = _Streams()
        first: CanaryHit | None = None
        for reading in read_body(body):
            if reading.texts:
                hit = self._feed(compiled, streams, reading.paths, reading.texts)
                first = first or hit
        return first

    def tail_of(self, index: int) -> str:
        """The tail kept for choice `index` of `feed_text` (for tests of its bound)."""
        return self._streams.tail(f"{SEP}#{index}")

    def _feed(
        self, compiled: _Compiled, streams: _Streams, paths: list[str], texts: list[str]
    ) -> CanaryHit | None:
        tails, prevs = streams.load(paths)
        windows = list(map(operator.add, tails, texts))  # the lists are aligned
        keep = compiled.tail_chars
        # One search over every window of the event first: no key (and no loose marker)
        # anywhere means no marker in any window, the common case. A match across the
        # separator is possible only as a false alarm, and that just takes the exact path.
        joined = "\x00".join(windows) if len(windows) > 1 else windows[0]
        if (compiled.keys is None or compiled.keys.search(joined) is None) and (
            compiled.loose is None or compiled.loose.search(joined) is None
        ):
            streams.store(paths, [w[-keep:] for w in windows], texts)
            return None
        first: CanaryHit | None = None
        new_tails = []
        for window, tail, prev, text in zip(windows, tails, prevs, texts, strict=True):
            hit, keep_from = self._search(compiled, window, len(tail), prev, text)
            first = first or hit
            new_tails.append(window[max(keep_from, len(window) - keep) :])
        streams.store(paths, new_tails, texts)
        return first

    def _search(
        self, compiled: _Compiled, window: str, tail_len: int, prev: str, text: str
    ) -> tuple[CanaryHit | None, int]:
        """Every non-overlapping marker match in `window` (tail + text), leftmost first;
        returns the first new hit and where the last match ended.

        A match inside the part of `text` that repeats the previous string at this path
        (SGLang's cumulative `/generate` text) was counted when that string was scanned:
        it is not counted again. The repeat is still scanned, so a stream read as
        incremental (the same text twice in a row) cannot hide a marker at the seam."""
        found = _find(compiled, window)
        if not found:
            return None, 0
        repeat_end = tail_len + len(prev) if prev and text.startswith(prev) else -1
        first: CanaryHit | None = None
        end = 0
        for start, stop, marker in found:
            if start < end:
                continue  # overlaps a match already counted
            end = stop
            if start >= tail_len and stop <= repeat_end:
                continue  # seen in the previous string at this path
            hit = CanaryHit(owner_tenant=marker.owner, marker_id=marker.marker_id)
            self.hit_count += 1
            if len(self.hits) < MAX_KEPT_HITS:
                self.hits.append(hit)
            first = first or hit
        return first, end


def _holds_no_start(compiled: _Compiled, data: bytes) -> bool:
    """No JSON escape and no marker's first character in `data` (the raw-bytes prefilter)."""
    starts = compiled.starts_utf8
    # find, not `in` (which first tries the needle as an integer: kvproxy.tokens.bound.guarantee).
    return starts is not None and data.find(b"\\") < 0 and starts.search(data) is None


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
    if _looks_past_match(parsed):
        raise ConfigError(
            f"{where} uses an anchor or lookaround (^ $ \\b \\A \\Z (?= (?! (?<= (?<!): "
            "responses are scanned through windows, so only the marker's own text may decide"
        )
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


def _looks_past_match(node: Any) -> bool:
    """Whether a parsed pattern holds an anchor or a lookaround anywhere."""
    if isinstance(node, _re_parser.SubPattern):
        return any(_looks_past_match(item) for item in node.data)
    if isinstance(node, (tuple, list)):
        if node and any(node[0] is op for op in _EDGE_OPS):
            return True
        return any(_looks_past_match(x) for x in node)
    return False


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
    firsts = {m.prefix[:1] for m in markers}
    starts: re.Pattern[str] | None = None
    starts_utf8: re.Pattern[bytes] | None = None
    if not firsts & _ADDED_BY_READING:
        alternatives = sorted(firsts)
        starts = re.compile("|".join(re.escape(c) for c in alternatives))
        starts_utf8 = re.compile(b"|".join(re.escape(c.encode()) for c in alternatives))
    keys = "|".join(re.escape(k) for k in sorted(by_key))
    # The wrapper group closes after any group inside a pattern, so `lastgroup` names it.
    loose_source = "|".join(f"(?P<{g}>{m.source})" for g, m in loose.items())
    return _Compiled(
        keys=re.compile(keys) if by_key else None,
        by_key={k: tuple(v) for k, v in by_key.items()},
        loose=re.compile(loose_source) if loose else None,
        loose_by_group=loose,
        tail_chars=max(m.max_chars for m in markers) - 1,
        starts=starts,
        starts_utf8=starts_utf8,
    )
