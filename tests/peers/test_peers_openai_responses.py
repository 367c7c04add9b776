"""The official `openai` SDK's Responses API through kvproxy in front of the PD simulator:
what the SDK sends is parsed and counted (a normal request is admitted and answered, one
over the limit lands in the SDK's BadRequestError with our code, and never reaches the
router), and a stored-context reference is refused naming the field."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from clients_support import MODEL, OVER_LIMIT_TEXT, proxy_before_sim, routed, sim_stats


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=30)


async def test_the_sdk_responses_call_is_counted(http: aiohttp.ClientSession) -> None:
    async with proxy_before_sim() as (proxy, sim), _client(proxy.public_url) as client:
        raw = await client.responses.with_raw_response.create(
            model=MODEL,
            instructions="be brief",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
            max_output_tokens=8,
        )
        assert raw.headers["x-kvproxy-decision"] == "admitted"
        assert raw.parse().output_text
        before = routed(await sim_stats(http, sim))
        with pytest.raises(openai.BadRequestError) as over:
            await client.responses.create(model=MODEL, input=OVER_LIMIT_TEXT, max_output_tokens=8)
        with pytest.raises(openai.BadRequestError) as stored:
            await client.responses.create(
                model=MODEL, input="and then?", previous_response_id="resp_1"
            )
        after = routed(await sim_stats(http, sim))
    assert over.value.code == "context_length_exceeded"
    assert over.value.param == "input"
    assert stored.value.code == "invalid_request"
    assert stored.value.param == "previous_response_id"
    assert after == before  # neither reached the router
