"""Fuzzing `decode_policy: clamp` (kvproxy/policy/clamp.py) over body shapes, every route.

Property: `clamp_output` returns a body kvproxy's own parser accepts, asking for at most the
cap, with the same batch and samples, or raises a 400 naming a problem (never quoting the
request). Anything else would be a 500 in the proxy, so hypothesis fails on it.
"""

from __future__ import annotations

import json
from typing import Any

from hostile_support import FUZZ_EXAMPLES, ROUTES, check_invalid_request, hostile_body, near_valid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy.policy.clamp import clamp_output
from kvproxy.policy.errors import KvproxyError
from kvproxy.policy.routes import Route
from kvproxy.prompt.parse import parse_request

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
sampling_shapes = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-5, 10**6)}),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-5, 10**6)}),
            st.integers(),
            st.none(),
            st.text(max_size=3),
        ),
        max_size=4,
    ),
    st.integers(),
    st.text(max_size=3),
)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=True).encode("ascii")


def _check(route: Route, body: bytes, cap: int) -> None:
    try:
        out = clamp_output(body, route, cap)
    except KvproxyError as err:
        check_invalid_request(err)
        return
    try:
        before = parse_request(route, body)
    except KvproxyError:
        return  # the proxy would have answered 400 before clamping
    after = parse_request(route, out)
    assert after.max_output_tokens is not None
    assert after.max_output_tokens <= cap
    assert after.n == before.n
    assert len(after.prompts) == len(before.prompts)


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    base=near_valid,
    sp=sampling_shapes,
    present=st.booleans(),
    cap=st.integers(1, 5_000),
)
def test_clamp_never_raises_anything_but_a_400(
    route: Route, base: dict[str, Any], sp: Any, present: bool, cap: int
) -> None:
    body = dict(base)
    if present:
        body["sampling_params"] = sp
    else:
        body.pop("sampling_params", None)
    _check(route, _dump(body), cap)


@FUZZ
@given(route=st.sampled_from(ROUTES), body=hostile_body, cap=st.integers(1, 5_000))
def test_clamp_on_any_hostile_body(route: Route, body: bytes, cap: int) -> None:
    _check(route, body, cap)
