"""Exact counters that run in this process: HF `tokenizers` and tiktoken.

Both are called only from worker threads (never on the event loop) and only through calls
that release the GIL: HF's `encode_batch_fast` (its plain `encode` holds the GIL for
seconds on 4 MB) and tiktoken's `encode_batch`. Text is cut with `bounds.exact_chunks`
where the tokenizer's pre-tokenizer cuts anyway, so counts stay exact while memory and
per-call time stay bounded; tokenizers whose family we cannot vouch for are fed whole.

Loading inspects the tokenizer once to decide what the byte bound may assume:
  * byte-level BPE with no normalizer: `bytes`; with NFC: `nfc`;
  * anything else (NFKC, SentencePiece/unigram, WordPiece): no guaranteed byte bound, so
    the counter never admits on the bound and always counts exactly (I1).
tiktoken panics (`pyo3_runtime.PanicException`, a BaseException) on ~1 M identical
whitespace characters; chunking avoids most of it and the counter turns the rest into a 503.

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
from typing import Any, Protocol

from kvproxy.tokens.bounds import (
    EXACT_CHUNK_CHARS,
    NFC_MAX_EXPANSION,
    BoundRule,
    exact_chunks,
    segment_chunks,
    text_bound,
)
from kvproxy.tokens.templates import ChatTemplate, from_tokenizer_dir_files

# Chunks per tokenizer call (~256 K characters): the call still runs in parallel, and
# freeing its results (HF keeps a Python-owned Encoding per chunk, one String per token)
# happens with the GIL held, so a batch must stay small: 4 MB at once froze the loop 40 ms.
BATCH_CHUNKS = 8
# Largest bound of one uncuttable chunk that is still encoded (see _Tally): ~6 ms to free.
UNCUT_TOKENS_MAX = 524_288
# cl100k/o200k-era split regex (also Qwen's tiktoken files): tiktoken files carry ranks only.
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# (tokens, exact): exact is False when an uncuttable stretch was charged its bound instead.
Counted = tuple[int, bool]


class _Tally:
    """Sums chunk counts; charges an uncuttable giant chunk its bound instead of encoding it.

    The tokenizer's result objects are freed with the GIL held (HF: one Rust String per
    token, ~11 ms per million; tiktoken: a list of ints). Chunks are small wherever the text
    can be cut; a stretch that cannot be cut and whose bound exceeds UNCUT_TOKENS_MAX
    (hostile: 1 M spaces, 400 K x U+0F73) is charged its guaranteed bound, which keeps I1.
    """

    def __init__(self, rule: BoundRule | None) -> None:
        self.rule = rule
        self.tokens = 0
        self.exact = True

    def oversized(self, chunk: str) -> bool:
        # Up to 4 UTF-8 bytes per character, times the NFC factor: below that, no check needed.
        if self.rule is None or len(chunk) * 4 * NFC_MAX_EXPANSION <= UNCUT_TOKENS_MAX:
            return False
        bound = text_bound(chunk, self.rule)
        if bound <= UNCUT_TOKENS_MAX:
            return False
        self.tokens += bound
        self.exact = False
        return True

    @property
    def result(self) -> Counted:
        return self.tokens, self.exact


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


@dataclass
class HfTokenizer:
    tokenizer: Any
    bound_rule: BoundRule | None
    special_tokens: int
    template: ChatTemplate | None
    chunkable: bool
    origin: str
    chunk_chars: int = EXACT_CHUNK_CHARS

    def count(self, texts: Sequence[str]) -> Counted:
        return self._encode(self._chunks(texts))

    def count_segments(self, segments: Sequence[str]) -> Counted:
        if self.chunkable:
            return self._encode(segment_chunks(segments, self.chunk_chars))
        return self._encode(iter(("".join(segments),)))

    def _encode(self, chunks: Iterator[str]) -> Counted:
        tally = _Tally(self.bound_rule)
        for batch in _batches(c for c in chunks if not tally.oversized(c)):
            encodings = self.tokenizer.encode_batch_fast(batch, add_special_tokens=False)
            tally.tokens += sum(len(e) for e in encodings)
        return tally.result

    def _chunks(self, texts: Sequence[str]) -> Iterator[str]:
        for t in texts:
            if not t:
                continue
            if self.chunkable:
                yield from exact_chunks(t, self.chunk_chars)
            else:
                yield t

    def describe(self) -> str:
        rule = self.bound_rule or "none (always exact)"
        return f"hf tokenizer {self.origin} (byte bound: {rule}; specials {self.special_tokens})"


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
        # HF tokenizers do.
        tally = _Tally(self.bound_rule)
        for c in chunks:
            if not tally.oversized(c):
                tally.tokens += len(self.encoding.encode(c, allowed_special="all"))
        return tally.result

    def describe(self) -> str:
        return f"tiktoken {self.origin} (byte bound: bytes)"


def _batches(chunks: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for c in chunks:
        batch.append(c)
        if len(batch) >= BATCH_CHUNKS:
            yield batch
            batch = []
    if batch:
        yield batch


# --- loading -------------------------------------------------------------------------------


def load_hf(path: str | Path) -> HfTokenizer:
    """A tokenizer.json, a tokenizer.json.zip, or a directory holding either (+ config)."""
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
    raw = _read_maybe_zipped(p)
    spec = json.loads(raw)
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
    template = from_tokenizer_dir_files(config_path, directory / "chat_template.jinja")
    # transformers' Llama-style classes add BOS/EOS from the config even when tokenizer.json's
    # post-processor does not; counting the larger keeps completions counts from falling short.
    from_config = int(bool(config.get("add_bos_token"))) + int(bool(config.get("add_eos_token")))
    specials = max(int(tok.num_special_tokens_to_add(False)), from_config)
    return HfTokenizer(
        tokenizer=tok,
        bound_rule=_hf_bound_rule(spec),
        special_tokens=specials,
        template=template,
        chunkable=_hf_chunkable(spec) and _self_test(tok),
        origin=str(path),
    )


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
