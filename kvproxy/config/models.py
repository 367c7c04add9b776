"""One model's slice of the settings, declared once, and the `models` entries built on it.

`ModelFields` is what belongs to one model's engines: the engines kvproxy measures, the
tokenizer and chat template that count its prompts, its declared context, its in-flight
budget. The top-level `Settings` inherits it (the single-model form: one implicit model that
answers to every name), and every entry of `models:` is a `ModelSpec` built on it (a name,
aliases, optionally its own upstream). `Settings.model_table()` turns either form into the
same list of specs and `Settings.for_model(spec)` into a complete `Settings` per model, so the
capacity monitor, the token counter and the budget are built for a model one way.

Why the top-level model fields are refused next to `models` instead of inherited: a
tokenizer, a pool or a budget belongs to one model's engines. Inheriting the top-level
tokenizer into a model that uses another one would count its prompts with the wrong
vocabulary, which is an I1 risk, not a convenience. So each entry states its own, and an
entry that states no tokenizer gets `bytes`, the bound that holds for any tokenizer.

Must never: let two entries answer to one name (a request would be counted against a pool
chosen by accident).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvproxy.policy import parse_origin

# Names travel in metric labels and logs: bounded length, no whitespace or control bytes.
NAME_PATTERN = r"^[^\s\x00-\x1f]{1,128}$"
# A cluster's name is the value of the `upstream` metric label (docs: gateway contract).
CLUSTER_NAME_PATTERN = r"^[^\s\x00-\x1f\x7f]{1,64}$"
# The name of the one model of the single-model form (its `model` metric label).
IMPLICIT_MODEL = "default"
# The name of the one cluster of a model configured with `upstream` and `engines`.
IMPLICIT_CLUSTER = "default"
# An HTTP header name (RFC 9110 token): the affinity header is read, never forwarded changed.
HEADER_NAME_PATTERN = r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,64}$"
# What sits between kvproxy and the engines (kvproxy.tokens.gate.verified): auto detects it.
RouterSetting = Literal["auto", "none", "smg", "sglang-router", "vllm-router"]


class EngineSpec(BaseModel):
    """One engine the capacity monitor polls directly (never through the router)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    url: str
    """The engine's own HTTP URL (not the router's). A headless Service name expands to one
    engine per Pod IP."""
    role: Literal["prefill", "decode", "unified"] = "unified"
    """Its role in the PD pair; `unified` serves both."""
    kind: Literal["sglang", "vllm", "static"] = "sglang"
    """How it is measured: SGLang's or vLLM's own endpoints, or `static` (not polled: the
    operator declares its pool in `capacity_tokens`)."""
    capacity_tokens: int | None = Field(default=None, ge=1)
    """Only for `kind: static`: the declared pool, always labelled `source="declared"`."""
    name: str | None = None
    """A name for metrics and logs; default the URL's host:port."""

    @model_validator(mode="after")
    def _static_needs_capacity(self) -> EngineSpec:
        if self.kind == "static" and self.capacity_tokens is None:
            raise ValueError("kind=static needs capacity_tokens")
        if self.kind != "static" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        rest = self.url.split("://", 1)[-1]
        # host:port only: a URL's credentials never become a name (labels, logs, /capacity).
        return rest.split("/", 1)[0].rpartition("@")[2] or "engine"


def check_tokenizer(v: str) -> str:
    """The tokenizer spelling shared by the single-model form and every `models` entry."""
    if v in ("auto", "bytes", "engine") or v.startswith(("hf:", "tiktoken:")):
        return v
    raise ValueError(f"must be auto, bytes, engine, hf:PATH or tiktoken:PATH, got {v!r}")


def effective_tokenizer(tokenizer: str, engines: tuple[EngineSpec, ...]) -> str:
    """What `auto` (the default) means for these engines: `engine` when any of them is an
    SGLang or vLLM engine, whose `/tokenize` is the model's own tokenizer, else `bytes`
    (static pools have no tokenizer to ask). Any other spelling is itself."""
    if tokenizer != "auto":
        return tokenizer
    return "engine" if any(e.kind in ("sglang", "vllm") for e in engines) else "bytes"


def check_url(v: str) -> str:
    if not v.startswith(("http://", "https://")):
        raise ValueError(f"must start with http:// or https://, got {v!r}")
    return v.rstrip("/")


def check_upstream(v: str) -> str:
    """A router URL the relay's client can reach (kvproxy.upstream's origin)."""
    v = check_url(v)
    parse_origin(v)
    return v


class UpstreamCluster(BaseModel):
    """One PD cluster serving a model (gateway mode): its router, the engines kvproxy
    measures for it alone, and its share of the traffic among the clusters a request fits."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=CLUSTER_NAME_PATTERN)
    """The cluster's name: the value of the `upstream` metric label."""
    url: str
    """Its router's URL (usually a Service)."""
    engines: tuple[EngineSpec, ...] = Field(min_length=1)
    """The engines kvproxy measures for this cluster alone."""
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Its share of traffic among the clusters that fit a request (kvproxy.policy.routing)."""
    router_kind: RouterSetting | None = None
    """What this cluster's router is; unset: the model's `router_kind`."""
    budget_pool: str | None = Field(default=None, min_length=1, max_length=128)
    """Its Redis budget pool; unset: `<model's pool or name>/<cluster name>` (one per pool)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_upstream(v)


class ModelFields(BaseModel):
    """The settings that belong to one model's engines (the top level or a `models` entry)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    engines: tuple[EngineSpec, ...] = ()
    """Every prefill and decode engine, polled directly: in PD mode a router's
    `/server_info` describes the first prefill worker only. In the environment a JSON list
    (`KVPROXY_ENGINES='[{"url": ..., "role": "prefill"}]'`); fields below."""
    max_context: int | None = Field(default=None, ge=1)
    """The declared context (what the model is served with); the admission limit is the
    minimum of it and every measured limit."""
    capacity_fallback_limit_tokens: int | None = Field(default=None, ge=1)
    """An explicit, operator-owned limit used only while no measurement is fresh; unset,
    requests are refused then (503 `capacity_unknown`, I3)."""
    tokenizer: str = "auto"
    """How prompts are counted. `auto`: the engines' own `/tokenize` when an SGLang or vLLM
    engine is configured (exact, asked only for prompts the byte bound cannot admit), else
    `bytes`. `hf:PATH`, `tiktoken:PATH`: local and exact (counting.md). `engine`: always
    `/tokenize`. `bytes`: a guaranteed bound only, which refuses legal prompts (English with
    Qwen-3 is admitted up to ~21 % of the limit) so the gate's "limit reachable" fails. On
    SGLang, chats are exact only with `chat_template` set (its `/tokenize` does not apply
    the template; vLLM's does). An engine that cannot answer in `count_timeout_s` fails
    the request closed (503 `token_count_unavailable`)."""
    chat_template: str | None = None
    """A Jinja chat template file, for counting chats when the tokenizer's own config has
    none (or for SGLang's `/tokenize`, which does not apply one)."""
    max_inflight_prompt_tokens: int | None = Field(default=None, ge=1)
    """In-flight budget in prompt tokens: a request is charged every sequence of its batch
    once per sample (`n`, `best_of`), and a deferred request keeps its share until its
    upstream is closed. Unset: no budget."""
    max_inflight_requests: int | None = Field(default=None, ge=1)
    """In-flight budget in requests (deferred ones included). Unset: no bound."""
    budget_pool: str | None = Field(default=None, min_length=1, max_length=128)
    """The Redis budget's pool, one per engine pool; unset, the model's name (`default` in
    the single-model form), so replicas in front of the same engines share it."""
    upstreams: tuple[UpstreamCluster, ...] = ()
    """Gateway mode: several PD clusters for this model, each with its own engines (so none
    at this level), picked per request by fit, then load (gateway.md). Unset: one cluster
    of `upstream` and `engines`."""
    extra_neutral_fields: tuple[str, ...] = ()
    """Top-level request fields the operator declares prompt-neutral for this model, beyond
    the fields kvproxy classifies per engine version (kvproxy/prompt/fields.py); any other
    field outside the table is refused (400 `unsupported_field`). List only fields the
    engine cannot turn into prompt tokens: kvproxy does not bound them."""
    trust_request_chat_template: bool = False
    """Accept a request's own chat template (top-level `chat_template`, or in
    `chat_template_kwargs`); refused (400) unless set. Set it only when the engine runs with
    `--trust-request-chat-template`: such a request is bounded by the same proof run over
    its own template (never the configured one) and decided on that bound alone."""
    media_processor: str | None = None
    """The model's image processor configuration (a `preprocessor_config.json`, or the model
    directory holding it; Qwen2-VL style): image parts are priced from their size and it
    (kvproxy/prompt/media.py). Unset: every media part is refused, naming its kind."""
    unseen_media: Literal["ceiling", "refuse"] = "ceiling"
    """What an image kvproxy cannot see into costs (a URL it never fetches, an unreadable
    header): `ceiling` charges the most any image can become under the processor, `refuse`
    answers 400."""

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        return check_tokenizer(v)

    @field_validator("upstreams")
    @classmethod
    def _unique_clusters(cls, v: tuple[UpstreamCluster, ...]) -> tuple[UpstreamCluster, ...]:
        seen: set[str] = set()
        for cluster in v:
            if cluster.name in seen:
                raise ValueError(f"cluster name {cluster.name!r} is used twice in upstreams")
            seen.add(cluster.name)
        return v

    @model_validator(mode="after")
    def _clusters_or_engines(self) -> ModelFields:
        # A pool belongs to one cluster's engines: engines beside upstreams would be measured
        # for no router, or for all of them (an I1 risk), so the two forms never mix.
        if self.upstreams and "engines" in self.model_fields_set:
            raise ValueError("engines cannot be set next to upstreams: set them in each cluster")
        return self


# Declared once, above; `Settings` refuses them at the top level next to `models`.
PER_MODEL_FIELDS: tuple[str, ...] = tuple(ModelFields.model_fields)


class ModelSpec(ModelFields):
    """One model: an entry of `models:`, or the implicit one of the single-model form."""

    # Defaults are validated too: an entry that names no engines is refused.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    name: str = Field(pattern=NAME_PATTERN)
    """What clients send in `model` (exact, case-sensitive); also the `model` metric label."""
    aliases: tuple[str, ...] = ()
    """Other names the router serves for this model's workers (forwarded unchanged)."""
    upstream: str | None = None
    """Its own router; unset: the top-level `upstream` (one router serving every model)."""
    router_kind: RouterSetting | None = None
    """What that router is; unset: the top-level `router_kind`."""
    affinity_header: str | None = Field(default=None, pattern=HEADER_NAME_PATTERN)
    """The header hashed over its candidate clusters; unset: the top-level
    `affinity_header`."""

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for alias in v:
            if not re.match(NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} must be 1-128 characters, no whitespace")
        return v

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        return None if v is None else check_upstream(v)

    @model_validator(mode="after")
    def _has_engines(self) -> ModelSpec:
        if not self.engines and not self.upstreams:
            raise ValueError("a models entry needs at least one engine (or upstreams)")
        if self.upstreams and self.upstream is not None:
            raise ValueError("upstream cannot be set next to upstreams: each cluster has its url")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def check_entries(specs: tuple[ModelSpec, ...], default_model: str | None) -> None:
    """The cross-entry rules of `models:` (ValueError: load_settings makes it one line)."""
    owner: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if name in owner:
                other = owner[name]
                where = "twice in models" if other == spec.name else f"by {other} and {spec.name}"
                raise ValueError(f"model name or alias {name!r} is used {where}")
            owner[name] = spec.name
    if default_model is not None and default_model not in owner:
        raise ValueError(f"default_model {default_model!r} names no models entry")
