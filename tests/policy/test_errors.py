"""Error shapes (kvproxy/policy/errors.py): one decision of the shape, from the route."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import orjson
import pytest

from kvproxy.policy import errors
from kvproxy.serve.replies import error_response


def test_the_route_decides_the_shape_and_openai_is_the_default() -> None:
    # SGLang's native routes (http_server.py: /generate, /encode, /classify).
    for route in ("generate", "encode", "native_classify"):
        assert errors.error_style(route) == "sglang"
    for route in ("chat", "completions", "responses", "messages", None, ""):
        assert errors.error_style(route) == "openai"


def test_every_outcome_has_both_shapes_and_the_stream_event_follows_the_style() -> None:
    err = errors.upstream_bad_response("oversized SSE event")
    event, done, tail = errors.sse_error_event(err, "sglang").split(b"\n\n")
    assert orjson.loads(event[6:]) == {"error": {"message": err.message}}
    assert (done, tail) == (b"data: [DONE]", b"")
    nested = orjson.loads(errors.sse_error_event(err, "openai").split(b"\n\n")[0][6:])
    assert nested["error"]["code"] == "upstream_bad_response"
    resp = error_response(errors.canary_violation(), {"X-Request-ID": "r"}, "sglang")
    assert resp.status == 502
    assert resp.body is not None
    assert orjson.loads(bytes(resp.body)) == {
        "error": {"message": errors.canary_violation().message}
    }
    assert resp.headers["X-Kvproxy-Error-Code"] == "canary_violation"


# --- errors survive the context managers they are raised through ---------------------------


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in kvproxy (imported module by module)."""
    import importlib
    import inspect
    import pkgutil

    import kvproxy

    found: list[type[BaseException]] = []
    for mod in pkgutil.walk_packages(kvproxy.__path__, "kvproxy."):
        if mod.name.endswith("__main__"):
            continue
        module = importlib.import_module(mod.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == mod.name:
                found.append(obj)
    return found


def test_no_exception_class_is_a_frozen_dataclass() -> None:
    """Python assigns __traceback__ to an exception carried through a contextlib context
    manager; a frozen dataclass refuses it and the request gets FrozenInstanceError."""
    import dataclasses

    classes = _exception_classes()
    assert errors.KvproxyError in classes
    assert errors.UpstreamFailure in classes
    frozen = [
        c.__qualname__
        for c in classes
        if dataclasses.is_dataclass(c) and c.__dataclass_params__.frozen
    ]
    assert frozen == []


def test_an_error_raised_through_context_managers_arrives_intact() -> None:
    import asyncio
    import contextlib

    @contextlib.contextmanager
    def sync_cm() -> Iterator[None]:
        yield

    @contextlib.asynccontextmanager
    async def async_cm() -> AsyncIterator[None]:
        yield

    raised = [
        errors.KvproxyError(400, "some_code", "a message", "reason"),
        errors.UpstreamFailure(502, "upstream_error", "m", "r", kind="reset", cause="X"),
    ]
    for err in raised:
        with pytest.raises(type(err)) as caught:
            with sync_cm():
                raise err
        assert caught.value is err
        assert caught.value.__traceback__ is not None

        async def through_async(e: errors.KvproxyError = err) -> None:
            async with async_cm():
                raise e

        with pytest.raises(type(err)) as caught:
            asyncio.run(through_async())
        assert caught.value is err
        assert caught.value.code == err.code
