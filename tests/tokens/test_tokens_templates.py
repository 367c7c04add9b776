"""Chat templates: placeholder rendering gives exactly the plain render, on the real
templates of Qwen-3, GLM-4 and DeepSeek-V3 and on templates that inspect their content."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import SequencePrompt
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.bound import bounds
from kvproxy.tokens.exact.local import HfTokenizer
from kvproxy.tokens.replica.templates import BIG_CHARS, ChatTemplate

BIG = ("Lorem ipsum dolor sit amet.\nConsectetur adipiscing elit " * 3000)[: BIG_CHARS + 500]
assert len(BIG) > BIG_CHARS


def shape(messages: list[dict[str, Any]], **extra: Any) -> SequencePrompt:
    body = orjson.dumps({"messages": messages, **extra})
    return parse_request("chat", body).prompts[0]


CONVERSATIONS = {
    "user": [{"role": "user", "content": BIG}],
    "system+user": [
        {"role": "system", "content": BIG},
        {"role": "user", "content": "short " + BIG},
    ],
    "assistant-think": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n" + BIG},
        {"role": "user", "content": BIG},
    ],
    "reasoning": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": BIG},
        {"role": "user", "content": "again"},
    ],
    "tools": [
        {"role": "user", "content": "call it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": "' + BIG + '"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": BIG},
    ],
    "parts": [{"role": "user", "content": [{"type": "text", "text": BIG}, "tail"]}],
}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]


@pytest.mark.parametrize("model", ["qwen-3", "glm-4", "deepseek-v3"])
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_segments_equal_plain_render(
    model: str, conv: str, hf_tokenizers: dict[str, HfTokenizer]
) -> None:
    tok = hf_tokenizers[model]
    assert tok.template is not None
    seq = shape(CONVERSATIONS[conv], tools=TOOLS if conv == "tools" else None)
    try:
        plain = tok.template.render(seq)
    except KvproxyError:
        pytest.skip(f"{model}'s template refuses this conversation")
    segments = tok.template.render_segments(seq)
    assert "".join(segments) == plain
    exact = len(tok.tokenizer.encode_batch_fast([plain], add_special_tokens=False)[0])
    assert tok.count_segments(segments) == (exact, True)
    assert "".join(bounds.segment_chunks(segments, 4096)) == plain
    assert tok.bound_rule is not None
    assert bounds.segments_bound(segments, tok.bound_rule) >= exact


def test_big_contents_become_segments_not_one_string() -> None:
    tmpl = ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    segments = tmpl.render_segments(shape([{"role": "user", "content": BIG}]))
    assert segments == ("[user]", BIG)
    assert segments[1] is BIG or segments[1] == BIG


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content | trim }}",
        "{{ messages[0].content[:100] }}",
        "{{ messages[0].content.upper() }}",
        "{{ messages[0].content | replace('a', 'b') }}",
        "{{ (messages[0].content + 'x') | indent(4) }}",
        "{{ messages[0] | tojson }}",
        "{{ messages[0].content.split('.')[0] }}",
        "{% for c in messages[0].content %}{% if loop.index < 3 %}{{ c }}{% endif %}{% endfor %}",
        "{{ messages[0].content if messages[0].content.startswith('Lorem') else 'no' }}",
        "{{ messages[0].content | length }}:{{ 'ipsum' in messages[0].content }}",
        "{% if messages[0].content == 'x' %}same{% endif %}{{ messages[0].content[-5:] }}",
    ],
)
def test_templates_that_look_inside_content_render_exactly(source: str) -> None:
    seq = shape([{"role": "user", "content": BIG}])
    # Each template draws a random placeholder marker; a bug that depends on the marker's
    # characters (replace('a', 'b') left markers without an 'a' untouched) shows only for
    # some draws, so try many.
    mismatches = 0
    # Except the loop over the content's 66 K characters (0.4 s a render, 17 s for 20 draws):
    # what a marker's characters change is a filter's or a method's result, not a loop's.
    draws = 3 if source.startswith("{% for c in") else 20
    for _ in range(draws):
        tmpl = ChatTemplate(source)
        same = "".join(tmpl.render_segments(seq)) == tmpl.render(seq)
        mismatches += not same  # a bool, so a failure never diffs two 64 KB strings
    assert mismatches == 0


TWO_BIG = [
    {"role": "user", "content": BIG},
    {"role": "assistant", "content": "Earlier: " + BIG},
    {"role": "user", "content": BIG},
]


@pytest.mark.parametrize(
    "source",
    [
        # a placeholder on the left of `in`: Python would test the marker, not the text
        "{% if messages[0].content in messages[1].content %}IN{% else %}OUT{% endif %}",
        "{% if messages[0].content not in messages[1].content %}OUT{% else %}IN{% endif %}",
        "{% if messages[0].content is in messages[1].content %}IN{% else %}OUT{% endif %}",
        "{% if messages[0].content in [messages[2].content] %}IN{% else %}OUT{% endif %}",
        "{% if messages[0].content in 'short text' %}IN{% else %}OUT{% endif %}",
        # plain strings built around a placeholder: length and equality of the marker
        "{% set s = messages[0].content ~ '!' %}{% if s | length > 1000 %}LONG{% endif %}",
        "{% if (messages[0].content ~ '') == messages[2].content %}EQ{% else %}NE{% endif %}",
        "{% if messages[0].content == messages[2].content %}EQ{% else %}NE{% endif %}",
        "{% if messages[0].content != messages[1].content %}NE{% else %}EQ{% endif %}",
        "{% if 1 < 2 in [True] %}chain{% endif %}",
    ],
)
def test_comparisons_on_big_contents_take_the_real_branch(source: str) -> None:
    seq = shape(TWO_BIG)
    # Every content printed once: a render that drops one is never spliced, which would hide
    # a wrong branch behind the plain-render fallback.
    tmpl = ChatTemplate(source + "{% for m in messages %}{{ m.content }}{% endfor %}")
    plain = tmpl.render(seq)
    segments = tmpl.render_segments(seq)
    assert "".join(segments) == plain, plain[:20]


def test_dropped_content_falls_back_to_plain_render() -> None:
    tmpl = ChatTemplate("{% if false %}{{ messages[0].content }}{% endif %}ok")
    assert tmpl.render_segments(shape([{"role": "user", "content": BIG}])) == ("ok",)


# --- the sandbox: a template is code, and the memoised safety verdicts must stay the sandbox's


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].pop('content') }}",  # mutating a dict
        "{{ messages.append(1) }}",  # mutating a list
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # escaping through dunders
    ],
)
def test_the_sandbox_refuses_what_a_hostile_template_tries(source: str) -> None:
    t = ChatTemplate(source)
    seq = shape([{"role": "user", "content": "hi"}])
    for _ in range(3):  # the first verdict is computed, the next ones remembered
        with pytest.raises(KvproxyError) as caught:
            t.render(seq)
        assert caught.value.status == 400


@pytest.mark.parametrize("source", ["{{ raise_exception.__globals__ }}", "{{ ''.__class__ }}"])
def test_unsafe_attributes_render_as_nothing(source: str) -> None:
    t = ChatTemplate(source)
    seq = shape([{"role": "user", "content": "hi"}])
    assert t.render(seq) == ""
    assert t.render(seq) == ""


def test_remembered_verdicts_are_per_type_safe_methods_still_work() -> None:
    """`items` is safe on a dict and `upper` on a str; `pop` is unsafe on the dict even
    after a safe method of the same dict type was remembered."""
    t = ChatTemplate(
        "{% for m in messages %}{% for k, v in m.items() %}{{ v.upper() }};{% endfor %}{% endfor %}"
    )
    seq = shape([{"role": "user", "content": "hi"}])
    assert t.render(seq) == "USER;HI;"
    assert t.render(seq) == "USER;HI;"
    pop = ChatTemplate("{{ messages[0].items() | list | length }}{{ messages[0].pop('role') }}")
    with pytest.raises(KvproxyError):
        pop.render(seq)
