"""The model table (kvproxy.serve.models): resolution by name and alias, the default model, the
single-model form matching every name, and readiness with several models. No sockets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import pytest

from kvproxy.policy.errors import KvproxyError
from kvproxy.policy.routing import Health
from kvproxy.serve.models import ClusterServices, ModelServices, ModelTable


@dataclass
class _Posture:
    blocks: bool = False

    def blocks_ready(self) -> bool:
        return self.blocks


@dataclass
class _Capacity:
    known: bool = True
    posture: _Posture = field(default_factory=_Posture)

    def ready(self) -> bool:
        return self.known


def svc(name: str, *aliases: str, known: bool = True) -> ModelServices:
    cluster = ClusterServices(
        name="default",
        url="http://127.0.0.1:1",
        weight=1.0,
        settings=cast(Any, None),
        capacity=cast(Any, _Capacity(known)),
        budget=cast(Any, None),
        health=Health(10, 120),
    )
    return ModelServices(
        name=name,
        aliases=aliases,
        settings=cast(Any, None),
        counter=cast(Any, None),
        clusters=(cluster,),
    )


def body(**fields: Any) -> bytes:
    return orjson.dumps({"messages": [], **fields})


def table(default: str | None = None, readiness: str = "any") -> ModelTable:
    a, b = svc("qwen", "Qwen/Qwen3-8B"), svc("glm")
    return ModelTable([a, b], default_model=default, readiness=readiness)


def test_name_and_alias_pick_their_model_exactly() -> None:
    t = table()
    assert cast(ModelServices, t.for_request(body(model="qwen"))).name == "qwen"
    assert cast(ModelServices, t.for_request(body(model="Qwen/Qwen3-8B"))).name == "qwen"
    assert cast(ModelServices, t.for_request(body(model="glm"))).name == "glm"
    # Case-sensitive, like smg's worker model ids: "GLM" is another name.
    err = t.for_request(body(model="GLM"))
    assert isinstance(err, KvproxyError)
    assert err.code == "model_not_found"
    assert t.names == ("qwen", "glm")


def test_unknown_or_missing_model_is_404_in_openai_shape_without_a_default() -> None:
    t = table()
    for raw in (body(model="llama"), body(), b'{"text": "x"}'):
        err = t.for_request(raw)
        assert isinstance(err, KvproxyError)
        assert (err.status, err.code, err.reason, err.param) == (
            404,
            "model_not_found",
            "model_not_found",
            "model",
        )
        shape = orjson.loads(err.body("openai"))["error"]
        assert shape["type"] == "invalid_request_error"
        assert shape["code"] == "model_not_found"
        assert "qwen, glm" in shape["message"]


def test_a_default_model_takes_unknown_and_missing_names() -> None:
    t = table(default="glm")
    for raw in (body(model="llama"), body(), b'{"text": "no model field (/generate)"}'):
        assert cast(ModelServices, t.for_request(raw)).name == "glm"
    assert cast(ModelServices, t.for_request(body(model="qwen"))).name == "qwen"


def test_a_body_that_is_not_an_object_or_a_model_that_is_not_a_string_is_400() -> None:
    t = table(default="glm")
    for raw, param in ((b"[1]", None), (b"{", None), (body(model=7), "model")):
        err = t.for_request(raw)
        assert isinstance(err, KvproxyError)
        assert err.status == 400
        assert err.param == param


def test_the_single_model_form_matches_every_name_without_reading_the_body() -> None:
    only = svc("default")
    t = ModelTable([only], default_model="default", implicit=True)
    for raw in (body(model="anything"), body(), b"not even json"):
        assert t.for_request(raw) is only
    assert t.resolve("whatever") is only


def test_readiness_any_and_all() -> None:
    a, b = svc("a"), svc("b", known=False)
    any_ = ModelTable([a, b], readiness="any")
    all_ = ModelTable([a, b], readiness="all")
    assert any_.ready()
    assert not all_.ready()
    assert "capacity unknown for b" in all_.not_ready_reason()
    cast(Any, a.capacity).known = False
    assert not any_.ready()
    cast(Any, a.capacity).known = True
    cast(Any, b.capacity).known = True
    assert all_.ready()
    # A blocking posture finding makes that model not ready, as in the single-model form.
    cast(Any, b.capacity).posture.blocks = True
    assert not all_.ready()
    assert any_.ready()


def test_a_table_refuses_duplicates_and_an_empty_list() -> None:
    with pytest.raises(ValueError, match="used twice"):
        ModelTable([svc("a", "x"), svc("x")])
    with pytest.raises(ValueError, match="at least one"):
        ModelTable([])
