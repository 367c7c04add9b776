"""The fastokens backend in service: start-up fallback to HF (a disagreeing, unloadable or
missing fastokens), the backend gauge, early-stopping exact counts, and the header through
the proxy equal to HF's own count of a near-limit completions prompt."""

from __future__ import annotations

import array
import gc
import io
import logging
import random
import threading
import weakref
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import tokenizers
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, static_engines
from prometheus_client.parser import text_string_to_metric_families
from tokenizer_files import real_tokenizer_dir
from tokenizers import Tokenizer

from kvproxy.config import Settings
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens import build_counter
from kvproxy.tokens.exact import fast
from kvproxy.tokens.exact.fast import load_fastokens, load_hf_counting

pytest.importorskip("fastokens")

COMPLETIONS = "/v1/completions"


class _Enc:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)


class Disagreeing:
    """A real fastokens tokenizer that counts one token too many wherever U+2028 appears:
    a narrow bug of the kind only a varied probe corpus finds."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def encode(self, text: str, add_special_tokens: bool = False) -> _Enc:
        ids = list(self.inner.encode(text, add_special_tokens=add_special_tokens).ids)
        return _Enc([*ids, 0] if "\u2028" in text else ids)

    def encode_batch_flat(
        self, texts: list[str], add_special_tokens: bool = False
    ) -> tuple[bytes, bytes]:
        ids = [i for t in texts for i in self.encode(t, add_special_tokens).ids]
        return array.array("I", ids).tobytes(), b""  # offsets: unused by kvproxy


def disagreeing(raw: str) -> Disagreeing:
    return Disagreeing(load_fastokens(raw))


class FakePanic(BaseException):  # like pyo3_runtime.PanicException
    pass


def test_a_disagreeing_fastokens_is_not_used_and_says_so_once(
    trained_bpe_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvproxy.tokens"):
        tok = load_hf_counting(trained_bpe_dir, load_fast=disagreeing)
    assert tok.backend == "hf"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "disagrees" in warnings[0].getMessage()
    assert "breaks" in warnings[0].getMessage()  # the probe that caught it
    # HF counts: the text the wrapper would over-count is counted as HF does.
    text = "a\u2028b and more"
    want = len(Tokenizer.from_file(str(trained_bpe_dir / "tokenizer.json")).encode(text))
    assert tok.count((text,)) == (want, True)


def test_the_real_fastokens_passes_and_hf_is_dropped(trained_bpe_dir: Path) -> None:
    tok = load_hf_counting(trained_bpe_dir)
    assert tok.backend == "fastokens"
    assert isinstance(tok, fast.FastTokenizer)
    text = "It's 12:30 — café 中文 👩‍👩‍👧‍👦\u2028x"
    want = len(Tokenizer.from_file(str(trained_bpe_dir / "tokenizer.json")).encode(text))
    assert tok.count((text,)) == (want, True)


@pytest.mark.parametrize("backend", ["fastokens", "hf"])
def test_hf_tokenizers_built_for_the_check_are_freed_once_fastokens_counts(
    backend: str, trained_bpe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # HF is the reference the start-up check holds fastokens to; once fastokens counts, no
    # HF tokenizer may stay alive (~60 MB for Qwen-3: the vocabulary held twice).
    built: list[weakref.ref[Any]] = []
    real = tokenizers.Tokenizer

    class Recording:
        @staticmethod
        def from_str(text: str) -> Any:
            tok = real.from_str(text)
            built.append(weakref.ref(tok))
            return tok

    monkeypatch.setattr(tokenizers, "Tokenizer", Recording)
    tok = load_hf_counting(trained_bpe_dir, use_fastokens=backend == "fastokens")
    gc.collect()
    assert tok.backend == backend
    assert built
    alive = [r for r in built if r() is not None]
    assert len(alive) == (0 if backend == "fastokens" else len(built))


def test_fastokens_counts_without_per_token_python_objects(trained_bpe_dir: Path) -> None:
    # encode/encode_batch build fastokens' table of one Python int per vocabulary id on
    # their first call (+6 MiB for Qwen-3); the check and every count use the flat buffer.
    # The check encodes off the calling thread: fastokens keeps per-thread encode state
    # (16 MiB for Qwen-3) for as long as the thread lives, and the start-up thread never ends.
    calls: list[tuple[str, int]] = []

    class FlatOnly:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            calls.append((name, threading.get_ident()))
            return getattr(self.inner, name)

    tok = load_hf_counting(trained_bpe_dir, load_fast=lambda raw: FlatOnly(load_fastokens(raw)))
    assert calls
    assert threading.get_ident() not in {thread for _, thread in calls}
    text = "It's 12:30 — café 中文 👩‍👩‍👧‍👦\u2028x " * 50
    want = len(Tokenizer.from_file(str(trained_bpe_dir / "tokenizer.json")).encode(text))
    assert tok.backend == "fastokens"
    assert tok.count((text,)) == (want, True)
    assert {name for name, _ in calls} == {"encode_batch_flat"}


@pytest.mark.parametrize(
    "failure", [FakePanic("panicked at src/lib.rs"), ValueError("unsupported: Metaspace")]
)
def test_a_tokenizer_fastokens_cannot_load_is_counted_by_hf(
    trained_bpe_dir: Path, failure: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(raw: str) -> Any:
        raise failure

    with caplog.at_level(logging.WARNING, logger="kvproxy.tokens"):
        tok = load_hf_counting(trained_bpe_dir, load_fast=broken)
    assert tok.backend == "hf"
    assert len(caplog.records) == 1
    assert "cannot load" in caplog.records[0].getMessage()


@pytest.mark.parametrize("backend", ["hf", "fastokens"])
def test_preset_truncation_and_padding_never_shape_a_count(
    backend: str, trained_bpe_dir: Path, tmp_path: Path
) -> None:
    # A tokenizer.json may carry truncation (an under-count would break I1) and padding
    # (three shipped Qwen-VL files do): engines encode with both off, so must we.
    tok = Tokenizer.from_file(str(trained_bpe_dir / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog. " * 200
    want = len(tok.encode(text))
    tok.enable_truncation(16)
    tok.enable_padding(length=4096)
    tok.save(str(tmp_path / "tokenizer.json"))

    def missing(raw: str) -> Any:
        raise ImportError("fastokens")

    got = load_hf_counting(tmp_path, load_fast=None if backend == "fastokens" else missing)
    assert got.backend == backend
    assert got.count((text,)) == (want, True)
    assert got.count((text[:45],))[0] < 4096


def test_without_fastokens_installed_hf_counts(trained_bpe_dir: Path) -> None:
    def missing(raw: str) -> Any:
        raise ImportError("No module named 'fastokens'")

    assert load_hf_counting(trained_bpe_dir, load_fast=missing).backend == "hf"


def _backend_gauge(metrics_text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "kvproxy_tokenizer_backend":
            return {s.labels["backend"]: s.value for s in family.samples}
    raise AssertionError("kvproxy_tokenizer_backend is not exported")


@pytest.mark.parametrize("agrees", [True, False])
async def test_the_gauge_shows_which_backend_counts(
    agrees: bool,
    trained_bpe_dir: Path,
    upstream: FakeUpstream,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not agrees:
        monkeypatch.setattr(fast, "load_fastokens", disagreeing)
    await upstream.start()
    async with running_proxy(upstream.url, tokenizer=f"hf:{trained_bpe_dir}") as proxy:
        metrics_url = proxy.admin_url + "/metrics"
        async with http.get(metrics_url, headers={"Accept-Encoding": "identity"}) as resp:
            gauge = _backend_gauge(await resp.text())
    in_use = "fastokens" if agrees else "hf"
    assert gauge[in_use] == 1
    assert sum(gauge.values()) == 1  # every other backend reads 0


# --- early stop ----------------------------------------------------------------------------


def _prose(n_chars: int, seed: int = 3) -> str:
    rng = random.Random(seed)
    words = [
        "the", "engine", "prefill", "decode", "cache", "tenant", "token", "pool", "page",
        "request", "Zürich", "東京"
    ]  # fmt: skip
    out, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20))) + ".\n"
        out.append(line[0].upper() + line[1:])
        size += len(line)
    return "".join(out)[:n_chars]


@pytest.fixture(scope="module")
def qwen_hf() -> Tokenizer:
    return Tokenizer.from_file(str(real_tokenizer_dir("qwen-3") / "tokenizer.json"))


async def test_counting_stops_once_the_decision_is_known(qwen_hf: Tokenizer) -> None:
    text = _prose(1_200_000)
    exact = len(qwen_hf.encode(text, add_special_tokens=True))
    shape = parse_request("completions", orjson.dumps({"prompt": text}))
    counter = build_counter(Settings(tokenizer=f"hf:{real_tokenizer_dir('qwen-3')}"))
    try:
        assert counter.backend == "fastokens"
        full = await counter.count(shape, exact)  # fits only by exact count: counted whole
        over = await counter.count(shape, exact // 3)  # far over: stops early
        fits = await counter.count(shape, exact + len(text) // 4)  # the rest's bound fits
    finally:
        await counter.aclose()
    assert (full.tokens, full.kind) == (exact, "exact")
    # A lower bound: over the limit, below the whole count (it stopped), never above it.
    assert over.kind == "lower-bound"
    assert over.at_least
    assert exact // 3 < over.tokens < exact
    # An upper bound: at least the exact count, within the limit (so admitted safely).
    assert fits.kind == "upper-bound"
    assert not fits.exact
    assert exact <= fits.tokens <= exact + len(text) // 4


# --- through the proxy: the header equals HF's count -------------------------------------


def _ok() -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"id": "c1", "choices": [{"text": "ok"}]})

    return handler


async def test_completions_header_equals_hf_count_near_the_limit(
    qwen_hf: Tokenizer, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # Two of the counter's batches (8 chunks of 32 K characters): counting far over the
    # limit stops after the first. (1 M characters cost 19 s here, HF's reference count most.)
    text = _prose(400_000, seed=11)
    want = len(qwen_hf.encode(text, add_special_tokens=True))  # HF, the reference
    body = orjson.dumps({"model": "m", "prompt": text, "max_tokens": 1})
    upstream.route("POST", COMPLETIONS, _ok())
    await upstream.start()
    seen = {}
    for limit in (want, want - 1, want // 2):
        async with running_proxy(
            upstream.url,
            tokenizer=f"hf:{real_tokenizer_dir('qwen-3')}",
            engines=static_engines(capacity=4 * want),
            max_context=limit,  # the admission limit (far below the measured pool)
        ) as proxy:
            assert proxy.services.models.first.counter.backend == "fastokens"
            async with http.post(proxy.public_url + COMPLETIONS, data=io.BytesIO(body)) as resp:
                seen[limit] = (resp.status, dict(resp.headers), await resp.json())
    status, headers, _ = seen[want]
    assert status == 200
    assert int(headers["X-Kvproxy-Prompt-Tokens"]) == want
    assert headers["X-Kvproxy-Prompt-Tokens-Kind"] == "exact"
    status, headers, reply = seen[want - 1]
    assert status == 400
    assert int(headers["X-Kvproxy-Prompt-Tokens"]) == want
    assert reply["error"]["prompt_tokens"] == want
    # Far over: counting stopped early; the header and the error say it is a floor.
    status, headers, reply = seen[want // 2]
    assert status == 400
    assert headers["X-Kvproxy-Prompt-Tokens-Kind"] == "lower-bound"
    assert want // 2 < int(headers["X-Kvproxy-Prompt-Tokens"]) < want
    assert "at least" in reply["error"]["message"]
    assert len(upstream.received) == 1  # only the admitted one reached the upstream
