"""Exact counters that run in this process: HF `tokenizers` and tiktoken (fastokens, the
fast backend verified against HF at start-up, lives in `fast` and reuses HfTokenizer).

Both are called only from worker threads (never on the event loop) and only through calls
that release the GIL: HF's `encode_batch_fast` (its plain `encode` holds the GIL for
seconds on 4 MB) and tiktoken's `encode_batch`. Text is cut with `bounds.exact_chunks`
where the tokenizer's pre-tokenizer cuts anyway, so counts stay exact while memory and
per-call time stay bounded; tokenizers whose family we cannot vouch for are fed whole.

The engines do not always tokenize with tokenizer.json as it is: transformers 5 rebuilds some
tokenizer classes from their own defaults (`hfbuild`). Loading builds every pipeline an
engine may have built from the directory, and every count is the largest of their counts:
exact where they agree, an upper bound where they differ. A class whose rebuild kvproxy does
not model leaves `unmodelled` set, and the counter does not count with it (fail closed).

Loading inspects the tokenizer once to decide what the byte bound may assume:
  * byte-level BPE with no normalizer: `bytes`; with NFC: `nfc`;
  * anything else (NFKC, SentencePiece/unigram, WordPiece): no guaranteed byte bound, so
    the counter never admits on the bound and always counts exactly (I1).
tiktoken panics (`pyo3_runtime.PanicException`, a BaseException) on ~1 M identical
whitespace characters; chunking avoids most of it and the counter turns the rest into a 503.
Counts that may stop early (`count_until`) stop once the decision is known; see `_encode`.

Nothing here logs or returns text.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

from kvproxy.tokens.bound import (
    EXACT_CHUNK_CHARS,
    NFC_MAX_EXPANSION,
    BoundRule,
    exact_chunks,
    segment_chunks,
    text_bound,
)
from kvproxy.tokens.replica import (
    ChatTemplate,
    dumps,
    engine_pipelines,
    from_tokenizer_dir_files,
)

# Chunks per tokenizer call (~256 K characters): the call still runs in parallel, and
# freeing its results (HF keeps a Python-owned Encoding per chunk, one String per token)
# happens with the GIL held, so a batch must stay small: 4 MB at once froze the loop 40 ms.
BATCH_CHUNKS = 8
# Largest bound of one uncuttable chunk HF still encodes (see HfTokenizer._charge): ~6 ms
# to free its result.
UNCUT_TOKENS_MAX = 524_288
# cl100k/o200k-era split regex (also Qwen's tiktoken files): tiktoken files carry ranks only.
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# (tokens, exact): exact is False when an uncuttable stretch was charged its bound instead.
Counted = tuple[int, bool]
# What a count that may stop early returns: "exact"; "upper" (a guaranteed upper bound: a
# stretch was charged its byte bound, or counting stopped once the rest's bound fitted);
# "lower" (counting stopped once the tokens counted so far exceeded the budget).
CountKind = Literal["exact", "upper", "lower"]


class Partial(NamedTuple):
    tokens: int
    kind: CountKind


class LocalTokenizer(Protocol):
    """What the counter needs from an in-process tokenizer."""

    # None: no guaranteed byte bound for this family; always count exactly.
    bound_rule: BoundRule | None
    # Tokens added around a sequence encoded with add_special_tokens=True.
    special_tokens: int
    template: ChatTemplate | None

    def count(self, texts: Sequence[str]) -> Counted:
        """Tokens of each text encoded without special tokens, summed. Thread, no GIL."""
        ...

    def count_segments(self, segments: Sequence[str]) -> Counted:
        """Tokens of the concatenation of `segments` (a rendered chat), without specials."""
        ...

    def describe(self) -> str: ...


@runtime_checkable
class EarlyStopping(Protocol):
    """A LocalTokenizer that can stop once the decision is known (see `HfTokenizer._encode`)."""

    def count_until(self, texts: Sequence[str], budget: int) -> Partial: ...

    def count_segments_until(self, segments: Sequence[str], budget: int) -> Partial: ...


@dataclass
class HfTokenizer:
    """HF `tokenizers` (the reference), chunked and batched; also the base of the fastokens
    backend (`kvproxy.tokens.exact.fast`), which differs only in the call that encodes a batch."""

    tokenizer: Any
    bound_rule: BoundRule | None
    special_tokens: int
    template: ChatTemplate | None
    chunkable: bool
    origin: str
    chunk_chars: int = EXACT_CHUNK_CHARS
    # False when tokenizer.json's post-processor and tokenizer_config.json disagree on the
    # special tokens a text prompt gets: `special_tokens` is then the larger (safe), and a
    # text prompt's count is an upper bound, not exact (engines differ by tokenizer class:
    # transformers 5 adds no BOS to DeepSeek-V3 text whose config asks for one).
    special_tokens_exact: bool = True
    # Further pipelines the engine may tokenize with (transformers' rebuild of the declared
    # class, `hfbuild`): every count is the largest over `tokenizer` and these.
    alternates: tuple[Any, ...] = ()
    # Why the engine's pipeline is unknown (a class kvproxy does not model): counts of this
    # tokenizer are never used (build_counter decides on the byte bound alone).
    unmodelled: str | None = None
    # One line on how the engine builds this tokenizer, for the start-up log.
    note: str = ""
    # Which library counts: the `kvproxy_tokenizer_backend` label.
    backend: ClassVar[str] = "hf"
    # Largest bound of an uncuttable chunk that is still encoded (see `_charge`); None:
    # every chunk is encoded.
    uncut_tokens_max: ClassVar[int | None] = UNCUT_TOKENS_MAX

    def count(self, texts: Sequence[str]) -> Counted:
        got = self._encode(list(self._chunks(texts)), None)
        return got.tokens, got.kind == "exact"

    def count_segments(self, segments: Sequence[str]) -> Counted:
        got = self._encode(self._segment_chunks(segments), None)
        return got.tokens, got.kind == "exact"

    def count_until(self, texts: Sequence[str], budget: int) -> Partial:
        return self._encode(list(self._chunks(texts)), budget)

    def count_segments_until(self, segments: Sequence[str], budget: int) -> Partial:
        return self._encode(self._segment_chunks(segments), budget)

    def _encode(self, chunks: list[str], budget: int | None) -> Partial:
        """Count `chunks` batch by batch; with a `budget`, stop as soon as the answer to
        "more than `budget` tokens?" is known.

        Chunked counts equal whole counts (`exact_chunks`), and each chunk's tokens are at
        most its own byte bound, so after each batch:
          * tokens counted exactly so far > budget: the whole is over it too ("lower");
          * so far + the bound of every chunk still to come <= budget: it fits ("upper").
        The rest's bound is computed only once its length alone could fit (a bound is never
        below the character count), so the check costs nothing on the way.

        With several pipelines (`alternates`) each keeps its own sum: the text is over the
        budget only when it is over it under every pipeline, it fits only when it fits under
        every one, and the count is exact only when all of them counted the same.
        """
        pipelines = (self.tokenizer, *self.alternates)
        counted = [0] * len(pipelines)
        charged = 0
        rest_chars = sum(len(c) for c in chunks)
        upper = False
        i, n = 0, len(chunks)
        while i < n:
            batch: list[str] = []
            while i < n and len(batch) < BATCH_CHUNKS:
                c = chunks[i]
                i += 1
                rest_chars -= len(c)
                bound = self._charge(c)
                if bound is None:
                    batch.append(c)
                else:
                    charged += bound
                    upper = True
            if batch:
                for k, tok in enumerate(pipelines):
                    counted[k] += self._tokens_with(tok, batch)
            if budget is None or i >= n:
                continue
            if min(counted) > budget:
                return Partial(min(counted), "lower")
            most = max(counted)
            if self.bound_rule is not None and most + charged + rest_chars <= budget:
                rest = sum(text_bound(c, self.bound_rule) for c in chunks[i:])
                if most + charged + rest <= budget:
                    return Partial(most + charged + rest, "upper")
        agree = min(counted) == max(counted)
        return Partial(max(counted) + charged, "exact" if agree and not upper else "upper")

    def _tokens_with(self, tok: Any, batch: list[str]) -> int:
        encodings = tok.encode_batch_fast(batch, add_special_tokens=False)
        return sum(len(e) for e in encodings)

    def _charge(self, chunk: str) -> int | None:
        """The bound to charge instead of encoding `chunk`, or None to encode it.

        HF keeps one Rust String per token in each result and frees them with the GIL held
        (~11 ms per million). Chunks are small wherever the text can be cut; a stretch that
        cannot be cut and whose bound exceeds `uncut_tokens_max` (hostile: 1 M spaces,
        400 K x U+0F73) is charged its guaranteed bound, which keeps I1.
        """
        limit = self.uncut_tokens_max
        rule = self.bound_rule
        # Up to 4 UTF-8 bytes per character, times the NFC factor: below that, no check needed.
        if limit is None or rule is None or len(chunk) * 4 * NFC_MAX_EXPANSION <= limit:
            return None
        bound = text_bound(chunk, rule)
        return bound if bound > limit else None

    def _chunks(self, texts: Sequence[str]) -> Iterator[str]:
        for t in texts:
            if not t:
                continue
            if self.chunkable:
                yield from exact_chunks(t, self.chunk_chars)
            else:
                yield t

    def _segment_chunks(self, segments: Sequence[str]) -> list[str]:
        if self.chunkable:
            return list(segment_chunks(segments, self.chunk_chars))
        return ["".join(segments)]

    def describe(self) -> str:
        rule = self.bound_rule or "none (always exact)"
        note = f"; {self.note}" if self.note else ""
        return (
            f"{self.backend} tokenizer {self.origin} (byte bound: {rule}; "
            f"specials {self.special_tokens}{note})"
        )


@dataclass
class TiktokenTokenizer:
    encoding: Any
    template: ChatTemplate | None
    origin: str
    bound_rule: BoundRule | None = "bytes"  # byte-level BPE, no normalizer
    special_tokens: int = 0

    def count(self, texts: Sequence[str]) -> Counted:
        return self._encode(c for t in texts if t for c in exact_chunks(t))

    def count_segments(self, segments: Sequence[str]) -> Counted:
        return self._encode(segment_chunks(segments))

    def _encode(self, chunks: Iterable[str]) -> Counted:
        # One chunk per call: `encode` runs in Rust without the GIL; `encode_batch` would
        # start a thread pool per call. Special-token text counts as the special token, as
        # HF tokenizers do. An uncuttable giant chunk is charged its bound (see
        # HfTokenizer._charge): tiktoken panics on ~1 M identical whitespace characters.
        tokens, exact = 0, True
        for c in chunks:
            if len(c) * 4 * NFC_MAX_EXPANSION > UNCUT_TOKENS_MAX:
                bound = text_bound(c, self.bound_rule or "nfc")
                if bound > UNCUT_TOKENS_MAX:
                    tokens += bound
                    exact = False
                    continue
            tokens += len(self.encoding.encode(c, allowed_special="all"))
        return tokens, exact

    backend: ClassVar[str] = "tiktoken"

    def describe(self) -> str:
        return f"tiktoken {self.origin} (byte bound: bytes)"


# --- loading -------------------------------------------------------------------------------


def load_hf(path: str | Path) -> HfTokenizer:
    """A tokenizer.json, a tokenizer.json.zip, or a directory holding either (+ config)."""
    return load_hf_json(path)[0]


def load_hf_json(path: str | Path) -> tuple[HfTokenizer, str]:
    """`load_hf`, plus the tokenizer.json text it read (for a second backend to load)."""
    hf, texts = load_hf_pipelines(path)
    return hf, texts[0]


def load_hf_pipelines(path: str | Path) -> tuple[HfTokenizer, tuple[str, ...]]:
    """`load_hf`, plus the tokenizer.json text of each pipeline it counts with (the file as
    transformers' generic class loads it, then `alternates`), for a second backend."""
    # One core per count (count_concurrency counts run at once): HF's own thread pool would
    # take every core, including the event loop's. An operator's explicit setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    p = Path(path)
    directory = p if p.is_dir() else p.parent
    if p.is_dir():
        candidates = [p / "tokenizer.json", p / "tokenizer.json.zip"]
        p = next((c for c in candidates if c.is_file()), candidates[0])
    if not p.is_file():
        raise ValueError(f"no tokenizer.json at {path}")
    raw = _read_maybe_zipped(p).decode("utf-8")
    spec = json.loads(raw)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
    pipes = engine_pipelines(spec, config, raw, _model_type(directory))
    texts = tuple(
        dumps(s) if changed else raw for s, changed in zip(pipes.specs, pipes.changed, strict=True)
    )
    toks = [Tokenizer.from_str(t) for t in texts]
    for tok in toks:
        # A tokenizer.json may preset truncation (an under-count: I1) or padding (batches
        # padded to their longest chunk: an over-count). Engines call the tokenizer with both
        # off (transformers disables them per call unless asked), so counting does too.
        tok.no_truncation()
        tok.no_padding()
    template = from_tokenizer_dir_files(config_path, directory / "chat_template.jinja")
    # transformers' Llama-style classes add BOS/EOS from the config even when tokenizer.json's
    # post-processor does not; counting the larger keeps completions counts from falling short.
    from_config = int(bool(config.get("add_bos_token"))) + int(bool(config.get("add_eos_token")))
    from_json = [int(tok.num_special_tokens_to_add(False)) for tok in toks]
    specials = max(*from_json, from_config)
    rules = [_hf_bound_rule(s) for s in pipes.specs]
    hf = HfTokenizer(
        tokenizer=toks[0],
        alternates=tuple(toks[1:]),
        bound_rule=_weakest(rules),
        special_tokens=specials,
        special_tokens_exact=min(from_json) == max(from_json) >= from_config,
        template=template,
        chunkable=all(_hf_chunkable(s) for s in pipes.specs) and all(map(_self_test, toks)),
        origin=str(path),
        unmodelled=pipes.unmodelled,
        note=pipes.note if config_path.is_file() else _BARE_FILE_NOTE,
    )
    return hf, texts


# Without tokenizer_config.json kvproxy cannot see the class the engine's directory declares.
_BARE_FILE_NOTE = (
    "no tokenizer_config.json beside it: counted as transformers loads a bare tokenizer.json; "
    "point hf: at the model's tokenizer directory so its declared class is built too"
)


def _model_type(directory: Path) -> str | None:
    """config.json's model_type when the tokenizer sits in a model directory (transformers
    may choose the tokenizer class by it: hfbuild.MODEL_TYPE_CLASS)."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text("utf-8")).get("model_type")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _weakest(rules: Sequence[BoundRule | None]) -> BoundRule | None:
    """The byte bound every pipeline keeps: none if one has none, NFC's if one needs it."""
    if any(r is None for r in rules):
        return None
    return "nfc" if "nfc" in rules else "bytes"


def release_load_garbage() -> None:
    """Hand the heap that loading freed back to the operating system.

    Parsing a tokenizer.json builds ~100 MB of transient objects (Qwen-3: the JSON text,
    serde's value tree, the Python dict) that glibc keeps in its arenas once freed, so RSS
    stayed ~100 MB above what the tokenizer really holds (measured 217 MB -> 110 MB after a
    trim). `malloc_trim` is glibc's; elsewhere this does nothing.
    """
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).malloc_trim(0)


def _read_maybe_zipped(p: Path) -> bytes:
    data = p.read_bytes()
    if p.suffix != ".zip":
        return data
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = [n for n in zf.namelist() if n.endswith("tokenizer.json")]
        if not names:
            raise ValueError(f"{p} holds no tokenizer.json")
        return zf.read(names[0])


def _kinds(node: Any, key: str) -> list[str]:
    """Types of a (possibly Sequence-wrapped) normalizer or pre-tokenizer."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [k for child in node.get(key, []) for k in _kinds(child, key)]
    return [str(node.get("type"))]


def _hf_bound_rule(spec: dict[str, Any]) -> BoundRule | None:
    model = spec.get("model", {})
    pre = _kinds(spec.get("pre_tokenizer"), "pretokenizers")
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        return None
    norms = _kinds(spec.get("normalizer"), "normalizers")
    if not norms:
        return "bytes"
    if norms == ["NFC"]:
        return "nfc"
    return None


def _nodes(node: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [n for child in node.get(key, []) for n in _nodes(child, key)]
    return [node]


def _hf_chunkable(spec: dict[str, Any]) -> bool:
    """Chunked counts equal whole counts only for byte-level BPE split by regex."""
    pre = _nodes(spec.get("pre_tokenizer"), "pretokenizers")
    if _hf_bound_rule(spec) is None or not {n.get("type") for n in pre} <= {"Split", "ByteLevel"}:
        return False
    # A prefix space would be added to every chunk, not once.
    if any(n.get("type") == "ByteLevel" and n.get("add_prefix_space") for n in pre):
        return False
    # An added token spanning a cut (it would contain whitespace) would be split by it.
    added = (str(t.get("content", "")) for t in spec.get("added_tokens", []))
    return not any(c.isspace() for a in added for c in a)


# Text for the load-time check that chunked counts equal whole counts: prose, code, CJK,
# contractions, digits, punctuation before newlines, NFC-sensitive characters.
_SELF_TEST = (
    "It's a test.\nWe'll see: 12345 apples and 3.14 pies\ndone\n"
    "def f(x):\n    return x  # ok\nclass A:\n pass\n"
    "中文文本，测试。\nこんにちは世界\nHangul 한국어 text\n"
    "Cafe\u0301 e\u0301t\u00e9\nZ\u0308 \U0001d160 ok\n"
    "!!!\nx?\nEND word word  word\tword\r\nword"
) * 4


def _self_test(tok: Any) -> bool:
    """Whole-text and finely chunked counts agree on a varied sample (catches odd regexes)."""
    whole = len(tok.encode_batch_fast([_SELF_TEST], add_special_tokens=False)[0])
    chunks = list(exact_chunks(_SELF_TEST, chunk_chars=1))
    parts = tok.encode_batch_fast(chunks, add_special_tokens=False)
    return len(chunks) > 10 and whole == sum(len(e) for e in parts)


def load_tiktoken(path: str | Path, template: ChatTemplate | None) -> TiktokenTokenizer:
    import base64

    import tiktoken

    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    enc = tiktoken.Encoding(
        name=Path(path).stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    return TiktokenTokenizer(encoding=enc, template=template, origin=str(path))
