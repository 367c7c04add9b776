"""`probe_engine` over real sockets against fake engines on 127.0.0.1: the happy paths
and every way an engine's answer can be useless (each must be a ProbeError with a
reason, never a guess and never a crash)."""

from __future__ import annotations

import aiohttp
import pytest
from capacity_fakes import EngineFactory
from ports import free_port

from kvproxy.capacity import ProbeError, probe_engine
from kvproxy.config import EngineSpec

TIMEOUT_S = 2.0


def spec_for(url: str, kind: str = "sglang", role: str = "prefill") -> EngineSpec:
    return EngineSpec(url=url, kind=kind, role=role)  # type: ignore[arg-type]


async def test_sglang_probe_measures_the_issue_numbers(
    engines: EngineFactory, session: aiohttp.ClientSession
) -> None:
    eng = await engines("sglang", pool=5322, context=8192)
    got = await probe_engine(session, spec_for(eng.url), TIMEOUT_S)
    # SGLang reports max_req_input_len 5,316 and refuses 5,316: the largest prompt is 5,315.
    assert eng.max_req_input_len() == 5316
    assert got.input_limit_tokens == 5315
    assert got.pool_tokens == 5322
    assert got.context_length == 8192
    assert got.input_limit_source == "server_info.max_req_input_len"
    assert eng.hits["/server_info"] == 1
    assert eng.hits["/metrics"] == 1
    assert eng.hits["/v1/models"] == 1


async def test_sglang_probe_falls_back_to_get_server_info(
    engines: EngineFactory, session: aiohttp.ClientSession
) -> None:
    eng = await engines("sglang")
    eng.mode = "legacy"
    eng.metrics_enabled = False
    got = await probe_engine(session, spec_for(eng.url), TIMEOUT_S)
    assert got.input_limit_tokens == 5315
    assert got.input_limit_source == "get_server_info.max_req_input_len"
    assert eng.hits["/get_server_info"] == 1
    assert any("/metrics unavailable" in n for n in got.notes)


async def test_vllm_probe_uses_kv_cache_size_tokens(
    engines: EngineFactory, session: aiohttp.ClientSession
) -> None:
    eng = await engines("vllm", pool=5322, context=8192)
    got = await probe_engine(session, spec_for(eng.url, "vllm", "unified"), TIMEOUT_S)
    assert got.pool_tokens == 5322
    assert "kv_cache_size_tokens" in got.pool_source
    assert got.input_limit_tokens == 5321
    assert got.decode_limit_tokens == 5322


@pytest.mark.parametrize(
    ("kind", "mode", "reason"),
    [
        ("sglang", "html", "not_json"),
        ("sglang", "html_500", "http_status"),
        ("sglang", "garbage", "not_json"),
        ("sglang", "wrong_type", "bad_type"),
        ("sglang", "not_found", "http_status"),
        ("vllm", "html", "not_metrics"),
        ("vllm", "html_500", "http_status"),
    ],
)
async def test_useless_answers_are_probe_errors(
    engines: EngineFactory, session: aiohttp.ClientSession, kind: str, mode: str, reason: str
) -> None:
    eng = await engines(kind)
    eng.mode = mode
    with pytest.raises(ProbeError) as exc:
        await probe_engine(session, spec_for(eng.url, kind), TIMEOUT_S)
    assert exc.value.reason == reason
    # Bodies are described, not quoted.
    assert "Login" not in exc.value.message
    assert "Bad Gateway" not in exc.value.message


async def test_hanging_engine_times_out(
    engines: EngineFactory, session: aiohttp.ClientSession
) -> None:
    eng = await engines("sglang")
    eng.mode = "hang"
    with pytest.raises(ProbeError) as exc:
        await probe_engine(session, spec_for(eng.url), 0.3)
    assert exc.value.reason == "timeout"
    assert eng.entered.is_set()


async def test_hanging_metrics_do_not_fail_an_sglang_probe(
    engines: EngineFactory, session: aiohttp.ClientSession
) -> None:
    # /metrics is a cross-check only: if it hangs the probe still answers from /server_info.
    eng = await engines("sglang")
    eng.metrics_mode = "hang"
    got = await probe_engine(session, spec_for(eng.url), 1.0)
    assert got.input_limit_tokens == 5315
    assert eng.entered.is_set()
    assert any("/metrics unavailable" in n for n in got.notes)


async def test_garbage_metrics_do_not_fail_an_sglang_probe(
    engines: EngineFactory, session: aiohttp.ClientSession
) -> None:
    eng = await engines("sglang")
    eng.metrics_mode = "html"
    got = await probe_engine(session, spec_for(eng.url), TIMEOUT_S)
    assert got.input_limit_tokens == 5315


async def test_engine_down_is_connect(session: aiohttp.ClientSession) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ProbeError) as exc:
        await probe_engine(session, spec_for(url), TIMEOUT_S)
    assert exc.value.reason == "connect"


async def test_unresolvable_name_is_dns(session: aiohttp.ClientSession) -> None:
    with pytest.raises(ProbeError) as exc:
        await probe_engine(session, spec_for("http://no-such-engine.invalid:30000"), TIMEOUT_S)
    assert exc.value.reason in ("dns", "timeout")


async def test_static_needs_no_network(session: aiohttp.ClientSession) -> None:
    spec = EngineSpec(url="static://p", kind="static", role="prefill", capacity_tokens=4096)
    got = await probe_engine(session, spec, TIMEOUT_S)
    assert (got.input_limit_tokens, got.source) == (4096, "declared")
