"""The declared sources of an SGLang measurement: each field of `SERVER_INFO_SOURCES`,
`RANK_SOURCES` and `METRICS_SOURCES`, reported smallest, is the source the measurement
names for its number (and the number it takes)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvproxy.capacity.measurement import EngineMeasurement
from kvproxy.capacity.sglang import (
    METRICS_SOURCES,
    RANK_SOURCES,
    SERVER_INFO_SOURCES,
    Number,
    measure_sglang,
)
from kvproxy.config import EngineSpec

UNIFIED = EngineSpec(url="http://10.0.0.3:30000", role="unified", kind="sglang")
BASE: dict[str, Any] = {
    "max_total_num_tokens": 100_000,
    "context_length": 50_000,
    "page_size": 64,
    "internal_states": [{"memory_usage": {"token_capacity": 100_000}}],
}
# Smaller than every BASE report of the same number, and a valid value for it.
SMALLER: dict[Number, int] = {
    "pool": 90_000,
    "swa": 80_000,
    "context": 40_000,
    "mril": 30_000,
    "page": 16,
}


def taken(m: EngineMeasurement, number: Number) -> tuple[int | None, str | None]:
    """The value and source the measurement shows for `number`."""
    if number in ("pool", "swa"):  # a smaller sliding-window pool is the pool
        return m.pool_tokens, m.pool_source
    if number == "context":
        return m.context_length, m.context_source
    if number == "page":
        return m.page_size, m.page_size_source
    # The engine's own max_req_input_len binds: the input limit is one below it.
    return m.input_limit_tokens + 1, m.input_limit_source


def put(obj: dict[str, Any], key: str, value: int) -> None:
    head, _, rest = key.partition(".")
    if rest:
        put(obj.setdefault(head, {}), rest, value)
    else:
        obj[key] = value


@pytest.mark.parametrize(("key", "number"), SERVER_INFO_SOURCES)
def test_each_server_info_source_is_named(key: str, number: Number) -> None:
    info = copy.deepcopy(BASE)
    put(info, key, SMALLER[number])
    got = measure_sglang(UNIFIED, info, measured_at=0.0)
    assert taken(got, number) == (SMALLER[number], f"server_info.{key}")
    assert f"server_info.{key}" in got.fields_present


@pytest.mark.parametrize(("key", "number"), RANK_SOURCES)
def test_each_rank_source_is_named(key: str, number: Number) -> None:
    info = copy.deepcopy(BASE)
    put(info["internal_states"][0], key, SMALLER[number])
    got = measure_sglang(UNIFIED, info, measured_at=0.0)
    assert taken(got, number) == (SMALLER[number], f"server_info.internal_states[0].{key}")


@pytest.mark.parametrize(("gauge", "number"), METRICS_SOURCES)
def test_each_metrics_source_is_named(gauge: str, number: Number) -> None:
    text = f'{gauge}{{dp_rank="0"}} {SMALLER[number]}\n'
    got = measure_sglang(UNIFIED, copy.deepcopy(BASE), metrics_text=text, measured_at=0.0)
    assert taken(got, number) == (SMALLER[number], f"metrics.{gauge}{{dp_rank=0}}")
