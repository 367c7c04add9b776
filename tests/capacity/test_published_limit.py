"""One published limit (issue #33.2): the largest prompt a client can send with at least one
output token is one number, and admission agrees with it for every engine kind and role mix;
live, the gauge, /capacity, the release gate's boundary probe and the refusals agree.

Engines are measured by the real readers (`measure_sglang`, `measure_vllm`,
`measure_static`) from reports synthesized the way the engines write them; the limits come
from `derive_limits`, the verdicts from `admission.decide`. The engine rules used as the
oracle below are restated from the facts file and the engines' source (SGLang: refuse
len >= max_req_input_len, max_req_len = min(context - 1, pool - 1), the scheduler's
page-aware clamp; vLLM: prompt + max_tokens <= max_model_len, the sequence within the pool),
not imported from kvproxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import running_proxy, serving

from kvproxy.capacity import EngineMeasurement
from kvproxy.capacity.limits import derive_limits
from kvproxy.capacity.probes import measure_static
from kvproxy.capacity.sglang import measure_sglang
from kvproxy.capacity.vllm import measure_vllm
from kvproxy.config import IMPLICIT_MODEL, EngineSpec
from kvproxy.policy import admission
from kvproxy.policy.admission import Admit, Policy, Reject
from kvproxy.policy.counts import TokenCount
from kvproxy.tools.check.gate import GateOptions, run_gate


@dataclass(frozen=True)
class Shape:
    max_output_tokens: int | None
    n: int = 1
    prompt_param: str = "prompt"
    generates: bool = True


def exact(tokens: int) -> TokenCount:
    return TokenCount(tokens, "exact", True, tokens)


# --- reports, as the engines write them -------------------------------------------------------


@dataclass(frozen=True)
class SGLangEngine:
    role: str  # prefill | decode | unified
    pool: int
    context: int
    page: int
    ranks: tuple[int, ...] = ()  # DP ranks' pools (rank 0 reports at the top level)

    def mode(self) -> str:
        return {"unified": "null"}.get(self.role, self.role)

    def info(self) -> dict[str, Any]:
        pool = self.ranks[0] if self.ranks else self.pool
        # SGLang (facts file): max_req_len = min(context - 1, pool - 1), minus 5, from rank 0.
        mril = min(self.context - 1, pool - 1) - 5
        info: dict[str, Any] = {
            "max_total_num_tokens": pool,
            "context_length": self.context,
            "max_req_input_len": mril,
            "page_size": self.page,
            "disaggregation_mode": self.mode(),
            "version": "0.5.23",
        }
        if self.ranks:
            info["dp_size"] = len(self.ranks)
            info["internal_states"] = [
                {"dp_rank": i, "memory_usage": {"token_capacity": p}}
                for i, p in enumerate(self.ranks)
            ]
        return info

    def smallest_pool(self) -> int:
        return min(self.ranks) if self.ranks else self.pool

    def serves(self, prompt: int, out: int) -> bool:
        """The engine accepts the prompt and generates `out` tokens without cutting them
        (tokenizer manager + scheduler, the strictest build of each; every DP rank)."""
        pool = self.smallest_pool()
        max_req_len = min(self.context - 1, pool - 1)
        if self.role != "decode" and prompt >= max_req_len - 5:
            return False
        if prompt + out >= self.context:  # older builds refuse at >=
            return False
        if self.role == "prefill":
            return True
        paged = -(-prompt // self.page) * self.page
        return out <= min(max_req_len - prompt - 1, pool - paged - self.page - 1)


@dataclass(frozen=True)
class VLLMEngine:
    role: str
    pool: int
    max_model_len: int

    def metrics(self) -> str:
        return (
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{self.pool // 16}",'
            f'kv_cache_size_tokens="{self.pool}"}} 1.0\n'
        )

    def models(self) -> dict[str, Any]:
        return {"data": [{"id": "m", "object": "model", "max_model_len": self.max_model_len}]}

    def serves(self, prompt: int, out: int) -> bool:
        # vLLM's renderer: prompt + max_tokens <= max_model_len; the sequence fits the pool.
        return prompt + out <= min(self.max_model_len, self.pool)


Engine = SGLangEngine | VLLMEngine


def measure(i: int, e: Engine | tuple[str, int]) -> EngineMeasurement:
    url = f"http://10.0.0.{i + 1}:30000"
    if isinstance(e, tuple):
        role, cap = e
        spec = EngineSpec(url=url, role=role, kind="static", capacity_tokens=cap)  # type: ignore[arg-type]
        return measure_static(spec, measured_at=0.0)
    if isinstance(e, VLLMEngine):
        spec = EngineSpec(url=url, role=e.role, kind="vllm")  # type: ignore[arg-type]
        return measure_vllm(spec, e.metrics(), e.models(), measured_at=0.0)
    spec = EngineSpec(url=url, role=e.role, kind="sglang")  # type: ignore[arg-type]
    return measure_sglang(spec, e.info(), measured_at=0.0)


# --- engine mixes -----------------------------------------------------------------------------

sizes = st.integers(300, 60_000)
pages = st.sampled_from([1, 16, 64])


@st.composite
def sglang_engine(draw: st.DrawFn, role: str, page: int, dp: bool = False) -> SGLangEngine:
    pool = draw(sizes) // page * page or page
    ranks: tuple[int, ...] = ()
    if dp:
        ranks = tuple(
            max(page, draw(st.integers(pool // 2, pool)) // page * page) for _ in range(4)
        )
    return SGLangEngine(role, pool, draw(sizes), page, ranks)


@st.composite
def mixes(draw: st.DrawFn) -> list[Engine | tuple[str, int]]:
    kind = draw(
        st.sampled_from(["sglang_unified", "sglang_pd", "sglang_dp", "vllm_pd", "static", "mixed"])
    )
    page = draw(pages)
    if kind == "sglang_unified":
        return [draw(sglang_engine("unified", page))]
    if kind in ("sglang_pd", "sglang_dp"):
        dp = kind == "sglang_dp"
        return [draw(sglang_engine("prefill", page, dp)), draw(sglang_engine("decode", page, dp))]
    if kind == "vllm_pd":
        return [VLLMEngine(r, draw(sizes), draw(sizes)) for r in ("prefill", "decode")]
    if kind == "static":
        out: list[Engine | tuple[str, int]] = [("prefill", draw(sizes))]
        if draw(st.booleans()):
            out.append(("decode", draw(sizes)))
        return out
    # A unified SGLang engine next to a vLLM one: each kind's own arithmetic, one limit.
    return [draw(sglang_engine("unified", page)), VLLMEngine("unified", draw(sizes), draw(sizes))]


@settings(max_examples=300)
@given(
    engines=mixes(),
    declared=st.none() | sizes,
    margin=st.sampled_from([0, 0, 15, 400]),
    clamp=st.booleans(),
    above=st.integers(1, 10_000),
)
def test_the_published_limit_is_what_admission_admits_with_one_output_token(
    engines: list[Engine | tuple[str, int]],
    declared: int | None,
    margin: int,
    clamp: bool,
    above: int,
) -> None:
    measured = [measure(i, e) for i, e in enumerate(engines)]
    lim = derive_limits(measured, max_context=declared, margin_tokens=margin)
    assert lim.known
    published = lim.admission_limit_tokens
    assert published is not None
    if published < 1:
        return
    policy = Policy("clamp" if clamp else "reject")
    for out in (1, None):  # max_tokens 1, or none named (the default output is one token)
        shape = Shape(out)
        at = admission.decide(exact(published), shape, lim, policy)
        assert isinstance(at, Admit), at
        assert at.clamped_output_tokens is None  # served with its token, not cut to fit
        assert admission.count_ceiling(shape, lim, policy) == published
        for over in (published + 1, published + above):
            verdict = admission.decide(exact(over), shape, lim, policy)
            assert isinstance(verdict, Reject)
            body = orjson.loads(verdict.error.body("openai"))["error"]
            # The refusal names the prompt (max_tokens is already the least it can be) and
            # the one published number, in its fields and in its message.
            assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt")
            assert body["limit_tokens"] == published
            assert f"at most {published:,} " in body["message"]
    # A route that generates nothing (embeddings) keeps the input-only limit.
    input_limit = lim.input_limit_tokens
    assert input_limit is not None
    assert input_limit >= published
    quiet = Shape(None, generates=False)
    assert isinstance(admission.decide(exact(input_limit), quiet, lim, policy), Admit)
    refused = admission.decide(exact(input_limit + 1), quiet, lim, policy)
    assert isinstance(refused, Reject)
    assert orjson.loads(refused.error.body())["error"]["limit_tokens"] == input_limit
    # The engines themselves: every measured engine serves the published prompt with its
    # one output token, uncut (declared static pools have no engine to ask).
    for e in engines:
        if not isinstance(e, tuple):
            assert e.serves(published, 1), (e, published)


def test_the_issues_unified_engine_publishes_4878() -> None:
    # One unified SGLang engine, pool 5,007, pages of 64: 5,000 with no output, but the
    # page-aware decode rule (pool - 2 x page) serves prompt + output up to 4,879.
    m = measure(0, SGLangEngine("unified", 5007, 8192, 64))
    lim = derive_limits([m], max_context=None)
    assert lim.admission_limit_tokens == 4878
    assert (lim.input_limit_tokens, lim.decode_limit_tokens) == (5000, 4879)
    assert lim.to_json()["admission_limit_tokens"] == 4878
    assert lim.to_json()["input_limit_tokens"] == 5000
    assert "4,878 with one output token" in lim.why
    shape = Shape(1)
    assert isinstance(admission.decide(exact(4878), shape, lim, Policy()), Admit)
    for n in (4879, 4999, 5000):
        verdict = admission.decide(exact(n), shape, lim, Policy())
        assert isinstance(verdict, Reject)
        assert verdict.error.param == "prompt"
        assert "accepts at most 4,878 " in verdict.error.message
    # Below the published limit but asking for more output than fits: that is max_tokens'.
    verdict = admission.decide(exact(4000), Shape(880), lim, Policy())
    assert isinstance(verdict, Reject)
    assert verdict.error.param == "max_tokens"
    assert "at most 879 output tokens fit" in verdict.error.message
    # With no output at all the input-only limit still holds (max_tokens 0).
    assert isinstance(admission.decide(exact(5000), Shape(0), lim, Policy()), Admit)


# --- every surface, live: the issue's engine behind kvproxy ------------------------------------


def unified_engine(served: list[int]) -> web.Application:
    """One unified SGLang engine as kvproxy sees it: pool 5,007 in pages of 64 (its
    /server_info), a byte tokenizer (its /tokenize) and completions that generate."""
    info = SGLangEngine("unified", 5007, 8192, 64).info()

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(info)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 8192}]})

    async def tokenize(request: web.Request) -> web.Response:
        ids = list(str((await request.json())["prompt"]).encode())
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 8192})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        served.append(len(str(body["prompt"]).encode()))
        usage = {"prompt_tokens": served[-1], "completion_tokens": 1}
        return web.json_response({"choices": [{"index": 0, "text": "x"}], "usage": usage})

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_the_gauge_capacity_gate_and_refusals_agree_on_4878() -> None:
    served: list[int] = []
    async with (
        serving(unified_engine(served)) as engine,
        running_proxy(engine, engines=[{"url": engine, "role": "unified"}]) as proxy,
        aiohttp.ClientSession() as http,
    ):
        gauge = proxy.metrics.admission_limit.labels(IMPLICIT_MODEL)._value.get()
        async with http.get(proxy.admin_url + "/capacity") as resp:
            limits = (await resp.json())["limits"]
        record = await run_gate(
            GateOptions(
                engines=proxy.settings.engines,
                max_context=None,
                proxy=proxy.public_url,
                proxy_admin=proxy.admin_url,
                probe_kind="text",
            ),
            lambda _: None,
        )
        replies = {}
        for n in (4878, 4879, 4999, 5000):
            body = {"model": "m", "prompt": "a" * n, "max_tokens": 1}
            async with http.post(proxy.public_url + "/v1/completions", json=body) as resp:
                replies[n] = (resp.status, await resp.json())
    assert gauge == 4878
    assert (limits["admission_limit_tokens"], limits["input_limit_tokens"]) == (4878, 5000)
    checks = {c.name: c for c in record.checks}
    for name in ("limit reachable", "proxy enforces the measured limit"):
        assert checks[name].passed, checks[name].detail
    assert "(4,878) admitted" in checks["limit reachable"].detail
    assert checks["boundary limit+1 (4,879 tokens)"].passed
    assert replies[4878][0] == 200
    assert 4878 in served  # it reached the engine and was served
    for n in (4879, 4999, 5000):
        status, err = replies[n][0], replies[n][1]["error"]
        assert status == 400
        assert (err["code"], err["param"], err["limit_tokens"]) == (
            "context_length_exceeded",
            "prompt",
            4878,
        )
        assert "accepts at most 4,878 " in err["message"]
    assert not {4879, 4999, 5000} & set(served)  # refused means untouched (I7)
