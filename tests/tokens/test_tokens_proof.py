"""The template proof (tokens.bound.proof): what it proves on small templates whose output is known,
what it refuses, and that every shipped template is proven in every variant.

Each case states the multiplicity a byte of an input can have (the proof's per-root factor),
which the rendered output can reach; `test_tokens_guarantee.py` checks the same on the real
templates against transformers.
"""

from __future__ import annotations

import pytest
import sweep
from chat_reference import model_dir, template_models

from kvproxy.tokens.bound.guarantee import ChatGuarantee
from kvproxy.tokens.bound.proof import prove
from kvproxy.tokens.bound.proof import sizes as sz
from kvproxy.tokens.bound.proof.filters import CASE_GROWTH
from kvproxy.tokens.bound.proof.sizes import Unproven
from kvproxy.tokens.exact.local import load_hf


def worst(source: str, root: str = "messages") -> int:
    """The most times one byte of `root` can be printed (P or X)."""
    f = sz.root_factors(prove(source).out, root)
    return max((a + b for a, b in f.px), default=0)


@pytest.mark.parametrize(
    ("source", "multiplicity"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", 1),
        # Both branches of a role test: still one print per message.
        (
            "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% else %}"
            "[{{ m.content }}]{% endif %}{% endfor %}",
            1,
        ),
        # Separate `if`s on the same field are exclusive (the body is partitioned by role).
        (
            "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}"
            "{% if m.role == 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
            1,
        ),
        # The first message printed before the loop and in it: twice.
        ("{{ messages[0].content }}{% for m in messages %}{{ m.content }}{% endfor %}", 2),
        # A string branch and a list branch print each byte once.
        (
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
            1,
        ),
        # An accumulator printed once after the loop.
        (
            "{% set ns = namespace(s='') %}{% for m in messages %}"
            "{% set ns.s = ns.s + m.content %}{% endfor %}{{ ns.s }}",
            1,
        ),
        # The same field printed twice in one iteration.
        ("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}", 2),
        # A piece of a string and the string, in two branches: the string, once.
        (
            "{% for m in messages %}{% set c = m.content %}{% if '</think>' in c %}"
            "{% set c = c.split('</think>')[-1] %}{% endif %}{{ c }}{% endfor %}",
            1,
        ),
    ],
)
def test_multiplicity(source: str, multiplicity: int) -> None:
    assert worst(source) == multiplicity


def test_static_text_per_iteration_is_counted_per_message() -> None:
    f = sz.root_factors(prove("{% for m in messages %}<turn>{% endfor %}").out, "messages")
    assert f.levels[0] == len("<turn>")


def test_an_accumulator_printed_in_its_loop_is_a_cross_term() -> None:
    """Printing the running concatenation every iteration is quadratic: the proof says so
    (a product of the count and the bytes), it does not call it linear."""
    out = prove(
        "{% set ns = namespace(s='') %}{% for m in messages %}"
        "{% set ns.s = ns.s + m.content %}{{ ns.s }}{% endfor %}"
    ).out
    cross = sz.nonlinear(out)
    assert any({v[0] for v in mono} == {"C", "P"} for _, mono in cross), cross


def test_a_tool_preamble_is_not_printed_without_tools() -> None:
    source = "{% if tools %}" + "x" * 500 + "{% endif %}{{ messages[0].content }}"
    assert sz.constant(prove(source).out) >= 500
    assert sz.constant(prove(source, tools=False).out) < 10  # the repr's brackets at most


def test_a_kwarg_branch_is_not_taken_without_kwargs() -> None:
    source = "{% if enable_thinking is defined %}" + "y" * 300 + "{% endif %}"
    assert sz.constant(prove(source).out) >= 300
    assert sz.constant(prove(source, kwargs=False).out) == 0


def test_a_recursive_macro_gets_a_summary() -> None:
    """MiniMax-M3's `to_xml` shape: a mapping's keys around the recursion on each value, a
    list's items likewise, a scalar printed once."""
    source = (
        "{% macro x(v) %}{% if v is mapping %}{% for k, w in v.items() %}<{{ k }}>{{ x(w) }}"
        "</{{ k }}>{% endfor %}{% elif v is iterable and v is not string %}{% for i in v %}"
        "<i>{{ x(i) }}</i>{% endfor %}{% else %}{{ v }}{% endif %}{% endmacro %}{{ x(tools) }}"
    )
    f = sz.root_factors(prove(source).out, "tools")
    # A key is printed twice, a leaf once: at most two prints of any byte.
    assert max(a + b for a, b in f.px) == 2


def test_a_recursion_whose_bound_does_not_close_is_refused() -> None:
    """The non-mapping branch prints a list whole, the mapping branch recurses into it: the
    proof cannot tell the branches apart by position, finds no fixpoint and says so."""
    source = (
        "{% macro x(v) %}{% if v is mapping %}{% for k, w in v.items() %}{{ x(w) }}"
        "{% endfor %}{% else %}{{ v }}{% endif %}{% endmacro %}{{ x(tools) }}"
    )
    with pytest.raises(Unproven, match="recursive macro x"):
        prove(source)


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("{% for m in messages %}{{ m.content * m.n }}{% endfor %}", "repeated"),
        ("{% include 'x' %}", "Include"),
        ("{{ messages|pprint }}", "pprint"),
        (
            "{% set ns = namespace(s='a') %}{% for m in messages %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
            "faster than a sum",
        ),
        ("{{ messages[0].content.format(1) }}", "format"),
    ],
)
def test_what_cannot_be_bounded_is_refused(source: str, why: str) -> None:
    with pytest.raises(Unproven, match=why):
        prove(source)


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
def test_case_mappings_grow_a_character_at_most_three_times() -> None:
    # Every character alone, by its UTF-8 size; map() keeps the 6.7 M calls in C (a Python
    # loop over them took 9 s of the fast suite).
    sizes = {1: (0, 0x80), 2: (0x80, 0x800), 3: (0x800, 0x10000), 4: (0x10000, 0x110000)}
    worst_growth = 0.0
    for size, (lo, hi) in sizes.items():
        chars = [chr(cp) for cp in range(lo, hi) if not 0xD800 <= cp <= 0xDFFF]
        for f in (str.lower, str.upper, str.title, str.capitalize, str.swapcase, str.casefold):
            longest = max(map(len, map(str.encode, map(f, chars))))
            worst_growth = max(worst_growth, longest / size)
    assert worst_growth <= CASE_GROWTH


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@pytest.mark.parametrize("model", sweep.every(template_models()))
def test_every_shipped_template_is_proven(model: str) -> None:
    local = load_hf(model_dir(model))
    assert local.template is not None
    g = ChatGuarantee.build(local.template.source, "bytes", 0, local.template.special_tokens)
    assert isinstance(g, ChatGuarantee), g
    assert len(g.variants) == 4
