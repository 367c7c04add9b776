"""kvproxy in front of the real vLLM NIXL pair (engines.py), judged on the engines' counters.

I2/I3: the pools and limits kvproxy measures are each engine's own (cache_config_info,
/v1/models); stale when an engine stops; the limit follows an engine restarted smaller.
I1: limit-1 / limit / limit+1 through kvproxy and straight to the prefill engine.
I5/I6: a client gone while its request waits in prefill's queue, or in the transfer phase
(prefill done, its KV pinned for decode's pull): kvproxy holds the upstream until decode has the
KV (decode's external_kv_transfer tokens) and counts the deferral; the same without kvproxy
leaves the prompt never computed (queued) or computed and never pulled (transfer phase).
The gate: `kvproxy canary` and `kvproxy check --config ... --canary --out DIR` pass on the
healthy stack with the measured pools in the record, and fail a declared context above them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from engines import (
    MODEL_NAME,
    Metrics,
    PDPair,
    VllmEngine,
    idle,
    running,
    wait_metrics,
)
from kvproxy_stack import (
    Kvproxy,
    body_of,
    engines_config,
    kvproxy_serve,
    leave,
    open_raw,
    post_chat,
    proxy_config,
)

SOURCE = "vllm:prompt_tokens_by_source_total"
DONE = "vllm:request_success_total"
DEFERRED = "kvproxy_deferred_cancellations_total"
GATE_TIMEOUT_S = 900
# Each long prompt asks for as many output tokens as it has characters (the repeat-your-
# context probe); a tiny CPU model writes ~100 tokens/s, ~10 under load: one round, short.
FAST_CANARY = ("--rounds", "1", "--prompt-chars", "300")
# The test router's hold between its legs (pd_test_router.py, POST /test/hold-decode): on a CPU
# the NIXL pull takes ~0.2 ms, so the window a client can leave in is opened on purpose. Long
# enough that the test sees prefill finish and leaves inside it on a loaded machine.
TRANSFER_HOLD_S = 10.0


def pool_of(m: Metrics) -> int:
    """The engine's own KV pool as it reports it: cache_config_info's kv_cache_size_tokens
    (vLLM 0.32 exports it; below blocks x block size, e.g. 7,148 of 56 x 128 here)."""
    (info,) = m.labels("vllm:cache_config_info")
    return int(info["kv_cache_size_tokens"])


def held(engine: VllmEngine) -> int:
    """Context the engine holds: min(--max-model-len, pool) (vLLM refuses to start otherwise)."""
    return min(engine.max_model_len, pool_of(engine.metrics()))


def count(engine: VllmEngine, content: str) -> int:
    """The engine's own count of a chat body (vLLM's /tokenize applies the template)."""
    status, out = post_json(
        engine.url + "/tokenize",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]},
    )
    assert status == 200, out
    return int(out["count"])


def post_json(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def content_of(engine: VllmEngine, tokens: int) -> str:
    """Text whose chat body the engine counts as exactly `tokens` (bounded search: each
    " hello" is one token of Qwen-3's tokenizer; the unique head keeps prefix caches cold)."""
    head = uuid.uuid4().hex
    n = max(0, tokens - count(engine, head))
    for _ in range(8):
        got = count(engine, head + " hello" * n)
        if got == tokens:
            return head + " hello" * n
        n += tokens - got
    raise AssertionError(f"no content of {tokens} tokens found")


@pytest.fixture(scope="module")
def proxy(vllm_pd: PDPair, real_logs: Path) -> Iterator[Kvproxy]:
    engines = engines_config((vllm_pd.prefill.url, "prefill"), (vllm_pd.decode.url, "decode"))
    with kvproxy_serve(real_logs, "kvproxy", proxy_config(vllm_pd.router_url, engines)) as p:
        yield p


def gauge_by_role(m: Metrics, name: str) -> dict[str, float]:
    return {s["role"]: m.value(name, role=s["role"]) for s in m.labels(name)}


# --- I2/I3: what kvproxy measures is each engine's own report --------------------------------


def test_pools_and_limits_are_each_engines_own(vllm_pd: PDPair, proxy: Kvproxy) -> None:
    prefill_pool = pool_of(vllm_pd.prefill.metrics())
    decode_pool = pool_of(vllm_pd.decode.metrics())
    assert prefill_pool != decode_pool  # the two sides differ on purpose
    m = proxy.metrics()
    assert gauge_by_role(m, "kvproxy_pool_capacity_tokens") == {
        "prefill": prefill_pool,
        "decode": decode_pool,
    }
    assert gauge_by_role(m, "kvproxy_engine_input_limit_tokens") == {
        "prefill": held(vllm_pd.prefill) - 1,
        "decode": held(vllm_pd.decode) - 1,
    }
    # The binding side is prefill's --max-model-len: one output token must fit.
    limit = min(held(vllm_pd.prefill), held(vllm_pd.decode)) - 1
    assert m.value("kvproxy_admission_limit_tokens") == limit
    assert m.value("kvproxy_capacity_known") == 1


# --- I1: the boundary, through kvproxy and straight to the engine -----------------------------


def test_limit_boundary_through_kvproxy_and_the_engines_own_verdict(
    vllm_pd: PDPair, proxy: Kvproxy
) -> None:
    limit = int(proxy.metrics().value("kvproxy_admission_limit_tokens"))
    prefill = vllm_pd.prefill
    bodies = {n: body_of(content_of(prefill, n)) for n in (limit - 1, limit, limit + 1)}
    for n in (limit - 1, limit):
        before = prefill.metrics()
        status, out = post_chat(proxy.url, bodies[n])
        assert status == 200, (n, out)
        assert out["usage"]["prompt_tokens"] == n
        after = wait_metrics(prefill, lambda m, b=before: m.value(DONE) > b.value(DONE), "done")
        assert (
            after.value(SOURCE, source="local_compute")
            - before.value(SOURCE, source="local_compute")
            == n
        )
    before = wait_metrics(prefill, idle, "idle")
    status, out = post_chat(proxy.url, bodies[limit + 1])
    assert status == 400, out
    assert out["error"]["code"] == "context_length_exceeded", out
    # Never reached prefill: its prompt counter did not move (a request sent after it is
    # counted, so the counters are known to be current).
    status_after, _ = post_chat(proxy.url, bodies[limit - 1])
    assert status_after == 200
    after = wait_metrics(prefill, lambda m: m.value(DONE) > before.value(DONE), "done")
    assert after.value("vllm:prompt_tokens_total") - before.value("vllm:prompt_tokens_total") == (
        limit - 1
    )
    # The engine's own verdict on the same bodies: limit served, limit+1 refused (vLLM 0.32
    # words it "max_tokens must be at least 1, got 0": no room for one output token).
    assert post_chat(prefill.url, bodies[limit])[0] == 200
    status, out = post_chat(prefill.url, bodies[limit + 1])
    assert status == 400, out


# --- I5/I6: a client gone while its request waits in prefill ---------------------------------


def queued_and_left(pair: PDPair, target: str, prompt_tokens: int) -> tuple[Metrics, Metrics]:
    """A blocker straight to prefill (--max-num-seqs 1) keeps it busy; the client's request
    through `target` waits in prefill's queue; the client leaves; then the blocker does.
    Returns the prefill and decode counters taken once the blocker ran (baseline)."""
    prefill, decode = pair.prefill, pair.decode
    wait_metrics(prefill, idle, "idle")
    blocker = open_raw(prefill.url, body_of(uuid.uuid4().hex, max_tokens=1900, ignore_eos=True))
    try:
        wait_metrics(prefill, lambda m: m.value("vllm:num_requests_running") == 1, "busy")
        p0, d0 = prefill.metrics(), decode.metrics()
        client = open_raw(target, body_of(content_of(prefill, prompt_tokens), max_tokens=4))
        wait_metrics(prefill, lambda m: m.value("vllm:num_requests_waiting") == 1, "queued it")
        leave(client)
    finally:
        leave(blocker)
    return p0, d0


def test_client_gone_while_queued_kvproxy_holds_until_decode_has_the_kv(
    vllm_pd: PDPair, proxy: Kvproxy
) -> None:
    n = 600
    m0 = proxy.metrics()
    p0, d0 = queued_and_left(vllm_pd, proxy.url, n)
    # kvproxy kept the upstream: prefill computed the prompt once the blocker left.
    held_until_decode_had_the_kv(vllm_pd, proxy, n, (m0, p0, d0))


def held_until_decode_had_the_kv(
    pair: PDPair, proxy: Kvproxy, n: int, before: tuple[Metrics, Metrics, Metrics]
) -> None:
    """After the client left: prefill computed the `n` prompt tokens once, decode pulled all of
    them over NIXL (computing none), and only then did kvproxy close the upstream, counting one
    deferral whose outcome is the first token or the end (`before`: kvproxy, prefill, decode)."""
    m0, p0, d0 = before
    d1 = wait_metrics(
        pair.decode,
        lambda m: (
            m.value(SOURCE, source="external_kv_transfer")
            - d0.value(SOURCE, source="external_kv_transfer")
            >= n
        ),
        "pulled the prompt over NIXL",
        timeout_s=TRANSFER_HOLD_S + 60,
    )
    pulled = d1.value(SOURCE, source="external_kv_transfer") - d0.value(
        SOURCE, source="external_kv_transfer"
    )
    assert pulled == n
    assert d1.value(SOURCE, source="local_compute") == d0.value(SOURCE, source="local_compute")
    p1 = wait_metrics(pair.prefill, idle, "idle")
    assert p1.value(SOURCE, source="local_compute") - p0.value(SOURCE, source="local_compute") == n
    after = _wait_deferral(proxy, m0)
    outcomes = {
        o: after.value(DEFERRED, outcome=o) - m0.value(DEFERRED, outcome=o)
        for o in ("first_token", "completed", "timeout", "shutdown")
    }
    assert outcomes["first_token"] + outcomes["completed"] == 1, outcomes
    assert outcomes["timeout"] == outcomes["shutdown"] == 0, outcomes


def _wait_deferral(proxy: Kvproxy, before: Metrics) -> Metrics:
    for _ in range(300):
        now = proxy.metrics()
        if now.value(DEFERRED) > before.value(DEFERRED):
            return now
        time.sleep(0.2)
    raise AssertionError(f"kvproxy counted no deferral; log:\n{proxy.log.read_text()[-3000:]}")


def test_client_gone_while_queued_without_kvproxy_nothing_reaches_decode(vllm_pd: PDPair) -> None:
    """The same through the test router alone: the router's upstream closes with the client,
    vLLM drops the queued request; the prompt is never computed and decode sees nothing."""
    p0, d0 = queued_and_left(vllm_pd, vllm_pd.router_url, 600)
    p1 = wait_metrics(vllm_pd.prefill, idle, "idle")
    d1 = wait_metrics(vllm_pd.decode, idle, "idle")
    assert p1.value(SOURCE, source="local_compute") - p0.value(SOURCE, source="local_compute") == 0
    assert d1.value("vllm:prompt_tokens_total") == d0.value("vllm:prompt_tokens_total")


# --- I5/I6: a client gone in the transfer phase ------------------------------------------------


def left_in_transfer_phase(pair: PDPair, target: str, n: int) -> tuple[Metrics, Metrics]:
    """The client's request (`n` prompt tokens) through `target`: prefill computes it, the
    router holds it before decode's leg; the client leaves inside that hold. Returns prefill
    and decode counters taken before the request (baseline); asserts decode had read nothing
    when the client left."""
    prefill, decode = pair.prefill, pair.decode
    wait_metrics(prefill, idle, "idle")
    wait_metrics(decode, idle, "idle")
    post_json(pair.router_url + "/test/hold-decode", {"seconds": TRANSFER_HOLD_S})
    p0, d0 = prefill.metrics(), decode.metrics()
    computed = p0.value(SOURCE, source="local_compute") + n
    client = open_raw(target, body_of(content_of(prefill, n), max_tokens=4))
    try:
        wait_metrics(
            prefill,
            lambda m: m.value(SOURCE, source="local_compute") >= computed and idle(m),
            "computed the prompt",
        )
        before_leaving = decode.metrics()
    finally:
        leave(client)
    assert before_leaving.value("vllm:prompt_tokens_total") == d0.value(
        "vllm:prompt_tokens_total"
    ), "decode had already been asked: the hold ended before the client left (machine too slow?)"
    return p0, d0


def test_client_gone_in_the_transfer_phase_kvproxy_holds_until_decode_has_the_kv(
    vllm_pd: PDPair, proxy: Kvproxy
) -> None:
    n = 600
    m0 = proxy.metrics()
    p0, d0 = left_in_transfer_phase(vllm_pd, proxy.url, n)
    held_until_decode_had_the_kv(vllm_pd, proxy, n, (m0, p0, d0))


def test_client_gone_in_the_transfer_phase_without_kvproxy_decode_never_pulls(
    vllm_pd: PDPair,
) -> None:
    """The same through the test router alone: the router's handler is cancelled with the
    client inside the hold, decode is never asked; the prompt was computed on prefill and its KV
    left pinned there for a pull that never comes (vLLM frees it at its abort timeout)."""
    n = 600
    p0, d0 = left_in_transfer_phase(vllm_pd, vllm_pd.router_url, n)
    log = vllm_pd.router_log
    for _ in range(300):
        if "client gone in the transfer phase" in log.read_text():
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the router never saw the client leave:\n" + log.read_text()[-2000:])
    p1 = wait_metrics(vllm_pd.prefill, idle, "idle")
    d1 = wait_metrics(vllm_pd.decode, idle, "idle")
    assert (
        p1.value(SOURCE, source="local_compute") - p0.value(SOURCE, source="local_compute") == 600
    )
    assert d1.value("vllm:prompt_tokens_total") == d0.value("vllm:prompt_tokens_total")


# --- the gate ---------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvproxy", *args],
        capture_output=True,
        text=True,
        timeout=GATE_TIMEOUT_S,
        check=False,
    )


def test_canary_passes_through_kvproxy(proxy: Kvproxy) -> None:
    out = run_cli("canary", "--target", proxy.url, "--proxy-admin", proxy.admin, *FAST_CANARY)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "not run: transfer_failure" in out.stdout + out.stderr


def gate_config(pair: PDPair, path: Path, max_context: int) -> Path:
    engines = engines_config((pair.prefill.url, "prefill"), (pair.decode.url, "decode"))
    path.write_text(yaml.safe_dump({"engines": engines, "max_context": max_context}))
    return path


def test_readme_gate_passes_on_the_healthy_real_stack(
    vllm_pd: PDPair, proxy: Kvproxy, tmp_path: Path
) -> None:
    declared = held(vllm_pd.prefill)  # what the operator serves with: prefill's context
    cfg = gate_config(vllm_pd, tmp_path / "kvproxy.yaml", declared)
    out_dir = tmp_path / "records"
    out = run_cli(
        "check", "--config", str(cfg), "--proxy", proxy.url, "--proxy-admin", proxy.admin,
        "--canary", "--canary-rounds", "1", "--canary-prompt-chars", "300", "--out", str(out_dir),
    )  # fmt: skip
    assert out.returncode == 0, (
        out.stdout[-4000:] + out.stderr[-3000:] + "\nkvproxy log:\n" + proxy.log.read_text()[-3000:]
    )
    record = json.loads((out_dir / "release-record.json").read_text())
    assert record["passed"] is True
    pools = {e["role"]: e["pool_tokens"] for e in record["engines"]}
    assert pools == {
        "prefill": pool_of(vllm_pd.prefill.metrics()),
        "decode": pool_of(vllm_pd.decode.metrics()),
    }
    how = {
        c["name"]: c["data"]["how"] for c in record["checks"] if c["name"].startswith("isolation ")
    }
    assert set(how) == {
        f"isolation {n}" for n in ("normal_long", "boundary", "cancel", "transfer_failure")
    }
    assert how["isolation transfer_failure"].startswith("not run: needs the simulator's fault API")
    assert all(v.startswith("ran: ") for k, v in how.items() if "transfer_failure" not in k)


def test_gate_fails_a_declared_context_above_the_measured_pool(
    vllm_pd: PDPair, proxy: Kvproxy, tmp_path: Path
) -> None:
    too_big = pool_of(vllm_pd.prefill.metrics()) + 1024
    cfg = gate_config(vllm_pd, tmp_path / "kvproxy.yaml", too_big)
    out = run_cli(
        "check", "--config", str(cfg), "--proxy", proxy.url, "--proxy-admin", proxy.admin,
        "--out", str(tmp_path / "records"),
    )  # fmt: skip
    assert out.returncode != 0, out.stdout[-3000:]
    record = json.loads((tmp_path / "records" / "release-record.json").read_text())
    assert "declared context fits every engine" in record["failed_checks"], record["failed_checks"]


# --- I2/I3: stale when the engine stops, the limit follows a smaller restart ------------------


def test_stale_when_the_engine_stops_and_the_limit_follows_a_smaller_restart(
    real_model: Path, real_logs: Path
) -> None:
    """A small unified engine of its own (the pair stays up): measured, stopped (capacity
    unknown, requests refused 503), restarted on the same port with fewer blocks and a
    shorter context (the limit follows it down)."""
    big = VllmEngine("restart-big", real_model, real_logs, 1536, 16)
    with running(big):
        # A short staleness bound of its own: the stop must show within seconds.
        cfg = proxy_config(big.url, engines_config((big.url, "unified")), capacity_stale_s=4.0)
        with kvproxy_serve(real_logs, "kvproxy-restart", cfg) as p:
            assert p.metrics().value("kvproxy_admission_limit_tokens") == held(big) - 1
            big.stop()
            stale = _wait_proxy(p, lambda m: m.value("kvproxy_capacity_known") == 0, "stale")
            assert stale.value("kvproxy_admission_limit_tokens") == 0
            status, out = post_chat(p.url, body_of("hi"))
            assert status == 503, out
            small = VllmEngine("restart-small", real_model, real_logs, 1024, 10, port=big.port)
            with running(small):
                want = held(small) - 1
                assert want < held(big) - 1
                _wait_proxy(
                    p, lambda m: m.value("kvproxy_admission_limit_tokens") == want, "followed"
                )
                assert p.metrics().value("kvproxy_pool_capacity_tokens") == pool_of(small.metrics())


def _wait_proxy(p: Kvproxy, until: Any, what: str) -> Metrics:
    for _ in range(300):
        m = p.metrics()
        if until(m):
            return m
        time.sleep(0.2)
    raise AssertionError(f"kvproxy never {what}; log:\n{p.log.read_text()[-3000:]}")
