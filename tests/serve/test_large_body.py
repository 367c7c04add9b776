"""The large-body path decides as the inline one does: the same bodies through one proxy with
the large-body threshold forced low (every body parsed in steps, kvproxy.serve.body
.parse_large, cut into many slices) and high (every body parsed in one call), and the same
answer each time: status, decision, prompt tokens and their kind, error code and field, and
the bytes the upstream received.

Ground truth is the inline path's answer and what the upstream recorded, not kvproxy's
internals; a spy checks the stepped parse really ran for each body in the low run.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, static_engines
from tokenizer_files import real_tokenizer_dir

from kvproxy.prompt import sliced
from kvproxy.serve import handler

# A proxy or a counter per test with the same `hf:` tokenizer: one load (tests/shared_loads.py).
pytestmark = pytest.mark.usefixtures("shared_tokenizer_loads")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TEXT = 'Résumé of "the plan":\n\t1. naïve café 中文文本 😀\\ then more prose. ' * 40
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": TEXT,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def dumped(doc: Any, ensure_ascii: bool = False) -> bytes:
    return json.dumps(doc, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


CORPUS: dict[str, tuple[str, bytes]] = {
    "chat": (CHAT, dumped(chat(TEXT))),
    "chat, every non-ASCII character escaped": (CHAT, dumped(chat(TEXT), ensure_ascii=True)),
    "chat over the limit": (CHAT, dumped(chat(TEXT * 30))),
    "chat, several long messages and a system prompt": (
        CHAT,
        dumped(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": TEXT[::-1]},
                    {"role": "user", "content": [{"type": "text", "text": TEXT}]},
                    {"role": "assistant", "content": TEXT},
                    {"role": "user", "content": "and?"},
                ],
            }
        ),
    ),
    "chat with tools": (CHAT, dumped(chat(TEXT, tools=TOOLS, tool_choice="auto"))),
    "chat with an image (no media processor: refused)": (
        CHAT,
        dumped(
            chat(
                [
                    {"type": "text", "text": TEXT},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + "A" * 9000},
                    },
                ]
            )
        ),
    ),
    "chat with an unknown field": (CHAT, dumped(chat(TEXT, not_a_field=TEXT))),
    "chat with a bad max_tokens": (CHAT, dumped(chat(TEXT) | {"max_tokens": "five"})),
    "completions": (COMPLETIONS, dumped({"model": "m", "prompt": TEXT, "max_tokens": 3})),
    "completions, a batch": (
        COMPLETIONS,
        dumped({"model": "m", "prompt": [TEXT, TEXT[:500]], "max_tokens": 3}),
    ),
    "completions, token ids": (
        COMPLETIONS,
        dumped({"model": "m", "prompt": list(range(3000)), "max_tokens": 3}),
    ),
    "truncated JSON": (CHAT, dumped(chat(TEXT))[:-3]),
    "invalid UTF-8 in the prompt": (
        CHAT,
        dumped(chat(TEXT)).replace("😀".encode(), b"\xf0\x9f", 1),
    ),
    "a lone surrogate escape in the prompt": (
        CHAT,
        dumped(chat(TEXT), ensure_ascii=True).replace(b"\\ude00", b"x", 1),
    ),
    "not an object": (CHAT, dumped([chat(TEXT)])),
    "a missing comma after the prompt": (
        CHAT,
        dumped(chat(TEXT)).replace(b'"}]', b'" "x": 1}]', 1),
    ),
}


def answer(status: int, headers: Any, reply: bytes, received: list[dict[str, Any]]) -> Any:
    error = orjson.loads(reply).get("error") if reply.startswith(b"{") else None
    return {
        "status": status,
        "decision": headers.get("X-Kvproxy-Decision"),
        "tokens": headers.get("X-Kvproxy-Prompt-Tokens"),
        "kind": headers.get("X-Kvproxy-Prompt-Tokens-Kind"),
        "error": error and (error.get("code"), error.get("param"), error.get("message")),
        "forwarded": [r["body"] for r in received],
    }


async def test_every_body_is_decided_alike_parsed_in_steps_or_in_one_call(
    upstream: FakeUpstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    for path in (CHAT, COMPLETIONS):
        upstream.route("POST", path, ok)
    await upstream.start()
    stepped = 0
    real = handler.parse_large

    async def spy(body: bytes) -> Any:
        nonlocal stepped
        stepped += 1
        return await real(body)

    monkeypatch.setattr(handler, "parse_large", spy)
    # Slices this small cut every body of the corpus in dozens of places.
    monkeypatch.setattr(sliced, "SLICE_BYTES", 512)
    monkeypatch.setattr(sliced, "LONG_LITERAL_BYTES", 64)
    model = str(real_tokenizer_dir("qwen-3"))
    engines = static_engines(capacity=20_000)
    answers: dict[str, dict[str, Any]] = {}
    async with running_proxy(upstream.url, engines=engines, tokenizer=f"hf:{model}") as proxy:
        for threshold in ("inline", "stepped"):
            # Every body is over 0 bytes; none is over 1 GiB.
            monkeypatch.setattr(
                handler, "LARGE_BODY_BYTES", 0 if threshold == "stepped" else 1 << 30
            )
            for name, (path, body) in CORPUS.items():
                upstream.received.clear()
                before = stepped
                async with http.post(proxy.public_url + path, data=body) as resp:
                    reply = await resp.read()
                    got = answer(resp.status, resp.headers, reply, upstream.received)
                assert stepped - before == (threshold == "stepped"), name
                answers.setdefault(name, {})[threshold] = got
    for name, by in answers.items():
        assert by["stepped"] == by["inline"], name
    # The corpus covers each way out: admitted and forwarded, refused on the count, refused
    # by the closed world or the media rules, and refused as malformed.
    statuses = {name: by["inline"]["status"] for name, by in answers.items()}
    assert statuses["chat"] == statuses["chat with tools"] == statuses["completions"] == 200
    assert answers["chat"]["inline"]["forwarded"] == [CORPUS["chat"][1]]
    over = answers["chat over the limit"]["inline"]
    assert over["error"][0] == "context_length_exceeded"
    assert over["kind"] == "exact"
    assert answers["chat with an unknown field"]["inline"]["error"][0] == "unsupported_field"
    for name in ("truncated JSON", "invalid UTF-8 in the prompt", "not an object"):
        assert statuses[name] == 400, name
        assert answers[name]["inline"]["forwarded"] == [], name
    image = answers["chat with an image (no media processor: refused)"]["inline"]
    assert image["error"][:2] == ("unsupported_field", "image_url")
