"""Settings: one frozen object, resolved once at start.

Sources, highest priority first: CLI overrides (passed as init kwargs), environment
(`KVPROXY_*`, `__` for nesting), the YAML file (`load_settings(config_path=...)`, which
`--config` feeds, else the one `KVPROXY_CONFIG` names), then the defaults below. An
invalid value raises `ConfigError` with one line naming the setting; the CLI turns that
into exit code 2.

`load_settings` is the one loader (serve, demo, check): it reads the environment and never
writes it, so the config path travels as an argument, not through `os.environ`.

Every default here is a safety decision; docs/configuration.md explains each one.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvproxy.config.models import (
    HEADER_NAME_PATTERN,
    IMPLICIT_CLUSTER,
    IMPLICIT_MODEL,
    PER_MODEL_FIELDS,
    ModelFields,
    ModelSpec,
    RouterSetting,
    UpstreamCluster,
    check_entries,
    check_upstream,
)
from kvproxy.observe import redact
from kvproxy.policy import ConfigError as ConfigError  # raised here; callers import it here

MIB = 1024 * 1024


def usable_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota
    (a container's `resources.limits.cpu`), rounded up; at least 1."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


class CanaryTenant(BaseModel):
    """Markers that belong to one tenant; seeing them in another tenant's reply is a leak."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    tenant: str = Field(min_length=1, max_length=64)
    """The tenant the markers belong to."""
    markers: tuple[str, ...] = ()
    """Literal marker strings."""
    patterns: tuple[str, ...] = ()
    """Regular expressions, e.g. `KVCANARY-acme-[0-9a-f]{16}` (no anchors or lookaround:
    text is scanned through windows)."""


class Settings(ModelFields, BaseSettings):
    """Every setting of one kvproxy process. The fields that belong to one model's engines
    (engines, tokenizer, chat template, declared context, budget) are `ModelFields`, declared
    once there: at the top level they are the single model of the single-model form."""

    model_config = SettingsConfigDict(
        env_prefix="KVPROXY_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        case_sensitive=False,
        # Each field's docstring is its description: docs/configuration.md's table is made
        # from them (`make docs`, kvproxy.config.doctables).
        use_attribute_docstrings=True,
    )

    # --- network -------------------------------------------------------------------------
    listen: str = "0.0.0.0:8080"
    """HOST:PORT of the public port, the only one the Service exposes to clients."""
    admin_listen: str = "0.0.0.0:9090"
    """HOST:PORT of `/metrics`, `/healthz`, `/readyz`, `/capacity`: never expose it publicly
    (the NetworkPolicy admits Prometheus and the release gate only)."""
    upstream: str = "http://127.0.0.1:8000"
    """The PD router in the same Pod (or an engine, `router_kind: none`)."""
    max_body_bytes: int = Field(default=32 * MIB, ge=1024)
    """Largest request body: a 1M-token prompt is 4-16 MiB of JSON. Oversize gets 413 on
    Content-Length, before reading; a `gzip`/`deflate` body is bounded again as it is
    inflated (zip bombs), then forwarded decoded (other codings: 415)."""
    body_read_timeout_s: float = Field(default=60.0, gt=0)
    """A client must deliver its whole body within this time, or get 408 (slowloris)."""
    header_read_timeout_s: float = Field(default=30.0, gt=0)
    """Every request head within this time: a connection's first within this time of
    connecting, every later one on a kept-alive connection within this time of its first
    byte (nginx's `client_header_timeout`); past it the connection is closed."""
    keepalive_timeout_s: float = Field(default=30.0, gt=0)
    """A kept-alive public connection with no request for this long is closed (nginx's
    `keepalive_timeout` is 75 s; shorter here because an idle socket holds a connection
    slot, though the connection limit closes the longest idle one before it sheds)."""
    max_request_head_bytes: int = Field(default=60 * 1024, ge=1024)
    """A request head (request line and fields) past this gets 431 and is never forwarded.
    Envoy's default (max_request_headers_kb 60); aiohttp bounds only each line (8,190 bytes)."""
    max_request_headers: int = Field(default=100, ge=1, le=128)
    """Header fields per request; past it, 431 (Envoy's max_headers_count; aiohttp refuses
    more than 128 by itself)."""
    forwarded_trusted_hops: int | None = Field(default=None, ge=0, le=16)
    """`X-Forwarded-For` gets the peer's address appended. Set, the number of proxies in front
    of kvproxy that append to it: only their addresses are kept (0: only the peer's, and the
    client's Forwarded / X-Real-IP / X-Forwarded-* are dropped). See routes.md, Headers."""
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    """The router is in the same Pod: a connect that takes longer is a dead router (502)."""
    upstream_read_timeout_s: float = Field(default=900.0, gt=0)
    """The longest silence between upstream bytes (504 after it): a 1M-token prefill sends
    nothing for minutes before its first byte."""
    upstream_keepalive_s: float = Field(default=15.0, gt=0)
    """Idle upstream connections are closed after this: shorter than the router's idle
    timeout, so kvproxy never POSTs on a connection the router is closing (aiohttp does not
    retry such a POST)."""
    upstream_max_connections: int = Field(default=1024, ge=1)
    """Connections open to the router (per upstream) at once; a request beyond it waits for
    one to free up."""
    upstream_send_timeout_s: float = Field(default=60.0, gt=0)
    """The longest the router may take no request-body bytes (nginx's `proxy_send_timeout`)."""
    upstream_max_head_bytes: int = Field(default=60 * 1024, ge=1024)
    """An upstream response head (status line, fields, interim heads) past this is a 502
    (Envoy's default; a router's head is under 1 KiB)."""
    upstream_max_headers: int = Field(default=100, ge=1)
    """Header fields of an upstream response head; past it, a 502 (Envoy's default)."""
    upstream_eject_s: float = Field(default=10.0, gt=0)
    """Gateway mode (`upstreams`): a cluster whose router refused a connection or answered
    5xx gets no request for this long while another cluster fits it, doubling per
    consecutive ejection up to `upstream_eject_max_s` (Envoy's outlier detection, shorter:
    the capacity probes watch the engines too)."""
    upstream_eject_max_s: float = Field(default=120.0, gt=0)
    """The longest ejection of a failing cluster (Envoy's max_ejection_time is 300 s)."""
    upstream_outlier_consecutive: int = Field(default=5, ge=1)
    """Outlier detection (gateway.md, "Passive health"): a cluster is ejected after this
    many consecutive failures (connect failures, resets or closes before a response head,
    head timeouts, 5xx heads the request did not cause; a 5xx counts once per tenant in a
    streak). Envoy's consecutive_5xx: 5."""
    upstream_outlier_max_ejected_share: float = Field(default=0.5, gt=0, le=1)
    """The largest share of a model's clusters ejected at once; one may always be, never the
    last (Envoy's max_ejection_percent is 10 % with at least one host)."""
    upstream_outlier_interval_s: float = Field(default=10.0, gt=0)
    """The success-rate window, and the healthy time that lowers the ejection back-off level
    by one (Envoy's interval: 10 s)."""
    upstream_outlier_success_rate_min_requests: int = Field(default=20, ge=1)
    """Success-rate ejection: only a cluster with at least this many outcomes in the window
    (and siblings with as many) is judged by its success rate."""
    upstream_outlier_success_rate_margin: float = Field(default=0.3, gt=0, le=1)
    """Success-rate ejection: a cluster whose success rate is more than this below its
    siblings' mean is ejected."""
    affinity_header: str | None = Field(default=None, pattern=HEADER_NAME_PATTERN)
    """Gateway mode: the header whose value is hashed over a model's candidate clusters
    (rendezvous hashing: a conversation keeps its prefix cache); a models entry may name
    its own."""
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    """After SIGTERM, in-flight requests and deferred cancellations get this long (the
    Pod's terminationGracePeriodSeconds must cover it, deploy/README.md)."""
    max_connections: int = Field(default=0, ge=0)
    """Public connections open at once before 503 `overloaded`; 0 derives it from the soft
    fd limit (an upstream connection per public one, 64 descriptors kept for the rest)."""
    max_body_memory_bytes: int = Field(default=48 * MIB, ge=1024)
    """Bytes of request bodies read or counted at once (counting multiplies a body's memory:
    JSON, the rendered chat, the encoding); beyond it 503 `overloaded`. At least
    `max_body_bytes`: 48 MiB is one largest body and room for 4 MB prompts 4 at a time."""
    body_memory_wait_s: float = Field(default=5.0, ge=0)
    """How long a body waits (first come, first served) for `max_body_memory_bytes` room
    before its 503."""

    # --- capacity (the engines and declared context: ModelFields) -------------------------
    capacity_refresh_s: float = Field(default=10.0, gt=0)
    """How often every engine's pool is measured."""
    capacity_stale_s: float = Field(default=60.0, gt=0)
    """A measurement older than this counts as unknown: fail closed (503 `capacity_unknown`,
    `/readyz` 503). At least `capacity_refresh_s`."""
    capacity_probe_timeout_s: float = Field(default=5.0, gt=0)
    """Bound on one engine measurement (and on detecting the router)."""
    limit_margin_tokens: int = Field(default=0, ge=0)
    """Tokens taken off the measured limit as a safety margin (what a 400 names as
    "minus a N-token safety margin"); `kvproxy check` applies the same."""

    # --- engine posture (kvproxy.posture) ---------------------------------------------------
    advisories_file: str | None = None
    """The operator's own engine advisories, same schema as the shipped table (release-gate.md,
    posture)."""
    accept_advisories: tuple[str, ...] = ()
    """Advisory ids accepted: listed in `/capacity`, the release record and the start log,
    but no longer blocking."""
    posture_action: Literal["warn", "not_ready"] = "warn"
    """What an active, unaccepted high-severity finding does: `warn` logs and reports it;
    `not_ready` also takes the proxy out of rotation (`/readyz` 503)."""

    # --- tokens and admission (the tokenizer and chat template: ModelFields) -------------
    router_kind: RouterSetting = "auto"
    """What sits between kvproxy and the engines: `smg`, `sglang-router`, `vllm-router`,
    `none` (the upstream is an engine) or `auto` (probed; until that succeeds only what
    holds behind every router is verified). It decides which request features the exact
    count may admit (kvproxy.tokens.gate.verified); per model as `models[].router_kind`."""
    count_timeout_s: float = Field(default=10.0, gt=0)
    """Bound on counting one prompt (an engine's `/tokenize`, or the local tokenizer's
    queue); past it the request fails closed with 503 `token_count_unavailable`."""
    tokenizer_backend: Literal["fastokens", "hf"] = "fastokens"
    """What counts an `hf:` tokenizer: `fastokens` (exact counts of long prompts ~20x
    faster; Qwen-3 resident ~205 MB in all) or `hf` (HF `tokenizers` alone: ~120 MB in all,
    for a sidecar under a 150 MB limit, every exact count ~20x slower). Both count the same:
    the start-up check holds fastokens to HF (operating.md, memory)."""
    count_concurrency: int = Field(
        default_factory=lambda: min(2, usable_cpus()),
        ge=1,
        json_schema_extra={"doc_default": "usable CPUs, at most 2"},
    )
    """Prompts counted at once. One per core this process may use, at most 2: on one core a
    second count thread doubled the CPU per 100k-token prompt (bench/PROFILE-LONG.md)."""
    image_tokens: int | None = Field(default=None, ge=0)
    """The least one image is charged: raises the cost computed from the image and the
    model's processor (`media_processor`), never lowers it. Unset: the computed cost."""
    audio_tokens: int = Field(default=16384, ge=0)
    """Unused: audio parts are refused (no per-second ceiling is modelled). Kept so that
    existing configurations still load."""
    decode_policy: Literal["reject", "clamp"] = "reject"
    """A request whose prompt plus requested output overflows the decode pool: `reject`
    (400 `context_length_exceeded`, reason decode_budget) or `clamp` (its max_tokens cut to
    what decode holds)."""
    default_output_tokens: int = Field(default=1, ge=1)
    """Output assumed per sample when a request names no max_tokens (decode needs room for at
    least one token)."""

    # --- deferred cancellation -----------------------------------------------------------
    drain_until: Literal["first_token", "completion"] = "first_token"
    """After the client left, how long the upstream stays open: `first_token` (it proves
    decode holds the KV) or `completion` (the whole response)."""
    drain_timeout_s: float = Field(default=300.0, gt=0)
    """The longest a deferred cancellation waits: SGLang's bootstrap/waiting timeouts are
    300 s, after which the engine gives the transfer up itself; shorter may cut a live one
    (see "Why the drain timeout is 300 s")."""
    queue_timeout_s: float = Field(default=30.0, ge=0)
    """How long a request waits for in-flight budget before its 429."""
    queue_max_waiters: int = Field(default=1024, ge=0)
    """Requests waiting for budget at once (per replica); beyond it, 429 at once."""
    budget_backend: Literal["local", "redis"] = "local"
    """Where the in-flight budget lives: `local` (this replica alone: N replicas may
    over-commit N-fold) or `redis` (one budget for every replica in front of the same
    engines, kvproxy.budget.cluster)."""
    redis_url: SecretStr | None = None
    """`redis://`, `rediss://` (TLS) or `unix://`; may carry a password (never logged)."""
    redis_password_file: Path | None = None
    """A file holding the Redis password (a mounted Secret); wins over `redis_password`."""
    redis_password: SecretStr | None = None
    """The Redis password (`KVPROXY_REDIS_PASSWORD` from a Secret); never logged."""
    redis_tls_ca_file: Path | None = None
    """CA bundle for `rediss://`."""
    redis_key_prefix: str = Field(default="kvproxy:budget", min_length=1)
    """Prefix of every Redis key the budget uses."""
    redis_lease_ttl_s: float = Field(default=15.0, ge=0.3)
    """A dead replica's leases come back after this long; live ones are renewed every third."""
    redis_timeout_s: float = Field(default=0.5, gt=0)
    """A Redis call slower than this counts as Redis unavailable."""
    redis_unavailable: Literal["local_share", "reject"] = "local_share"
    """While Redis is unavailable: `local_share` (each replica enforces
    budget / `budget_expected_replicas`) or `reject` (503 `budget_unavailable`)."""
    budget_expected_replicas: int = Field(default=1, ge=1)
    """The replica count `local_share` divides the budget by (keep it at the replica count,
    or the HPA's minReplicas)."""

    # --- tenants and canaries ------------------------------------------------------------
    tenant_header: str = "X-Tenant-ID"
    """The header naming a request's tenant (read only with `trust_tenant_header`)."""
    trust_tenant_header: bool = False
    """Believe `tenant_header`: only behind an authenticating gateway; otherwise it is
    stripped and the tenant comes from the bearer token."""
    tenant_tokens: dict[str, str] = Field(default_factory=dict)
    """Bearer token -> tenant. A secret: inject `KVPROXY_TENANT_TOKENS` from a Secret; tokens
    never appear in logs or labels."""
    tenant_hash_salt: str = "kvproxy"
    """Key of the HMAC that turns an unmapped bearer token into its anonymous tenant id
    (`anon-` and 8 hex digits, in logs and the tripwire): set your own so ids cannot be
    matched to tokens elsewhere."""
    canaries: tuple[CanaryTenant, ...] = ()
    """Each tenant's markers; one seen in another tenant's response is a leak (the tripwire,
    see "Tenants and the canary tripwire")."""
    canary_action: Literal["block", "observe"] = "block"
    """On a tripwire hit: `block` (cut the stream / answer 502 `canary_violation`) or
    `observe` (count only)."""

    # --- routes --------------------------------------------------------------------------
    passthrough_routes: tuple[str, ...] = ()
    """Extra routes forwarded WITHOUT counting (`"/path"`, `"GET /path"`,
    `"GET,HEAD /prefix/*"`), on top of the built-in ones clients need (`/health`,
    `/v1/models`, tokenize): the upstreams' metrics, load, server info and admin routes reach
    them only when listed here. Their bodies reach the upstream unexamined: list only routes
    that cannot carry a prompt to a KV cache (routes.md)."""

    # --- several models (kvproxy.config.models) ------------------------------------------
    models: tuple[ModelSpec, ...] = ()
    """Several models, each with its own engines, tokenizer, template, limits and budget; a
    request is counted against the entry its `model` names. Empty: the top-level settings
    are one model that matches every name (see "Several models behind one kvproxy")."""
    default_model: str | None = None
    """The entry for a request that names no model (SGLang's /generate) or an unknown one;
    unset, those get 404 `model_not_found`."""
    readiness: Literal["any", "all"] = "any"
    """`/readyz` with several models: `any` (ready while one model has fresh capacity; the
    others answer 503 per request) or `all` (every model measured)."""

    # --- logging -------------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Level of kvproxy's log (JSON lines on stderr; prompts and completions are never
    logged)."""
    access_log: bool = True
    """One JSON log line per request (its route, decision, status and timings; never its
    text)."""

    # Where this object's values came from (load_settings sets it): for errors found after
    # loading, such as a chat template file that does not open (`where`).
    _origin: Origin | None = PrivateAttr(default=None)

    def where(self, name: str, value: object = None) -> str:
        """Where setting `name` was given, for an error message: the flag, the environment
        variable actually set, or the config file and line; else its environment name.
        With `value` (never a secret's), the value too: `KVPROXY_X=v`, `FILE line N: v`."""
        src = (self._origin or Origin()).describe(name)
        if value is None:
            return src
        is_name = src.upper().startswith("KVPROXY_") or src.startswith("--")
        return f"{src}={value}" if is_name else f"{src}: {value}"

    @field_validator("listen", "admin_listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        split_host_port(v)
        return v

    @field_validator("upstream")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_upstream(v)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: SecretStr | None) -> SecretStr | None:
        # The message names the scheme only: the URL may hold a password.
        if v is not None and not v.get_secret_value().startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @field_validator("passthrough_routes")
    @classmethod
    def _passthrough(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from kvproxy.policy import parse_passthrough  # the allowlist's one parser

        parse_passthrough(v)
        return v

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.capacity_stale_s < self.capacity_refresh_s:
            raise ValueError("capacity_stale_s must be >= capacity_refresh_s")
        if self.upstream_eject_max_s < self.upstream_eject_s:
            raise ValueError("upstream_eject_max_s must be >= upstream_eject_s")
        if self.upstreams and "upstream" in self.model_fields_set:
            raise ValueError("upstream cannot be set next to upstreams: each cluster has its url")
        if self.max_body_memory_bytes < self.max_body_bytes:
            raise ValueError(
                "max_body_memory_bytes must be >= max_body_bytes (a largest body must fit)"
            )
        if self.budget_backend == "redis" and self.redis_url is None:
            raise ValueError("budget_backend redis needs redis_url")
        from kvproxy.posture import load_table  # pure: imports nothing of config

        load_table(self.advisories_file, self.accept_advisories)  # AdvisoryError: ValueError
        if self.models:
            mixed = [f for f in PER_MODEL_FIELDS if f in self.model_fields_set]
            if mixed:
                raise ValueError(
                    f"{', '.join(mixed)} cannot be set next to models: set them in each "
                    "models entry"
                )
            check_entries(self.models, self.default_model)
        elif self.default_model is not None:
            raise ValueError("default_model needs a models list")
        return self

    def model_table(self) -> tuple[ModelSpec, ...]:
        """Every model, in configured order: the `models` entries, or the one implicit model
        of the single-model form (named `IMPLICIT_MODEL`, the top-level model fields)."""
        if self.models:
            return self.models
        fields = {f: getattr(self, f) for f in PER_MODEL_FIELDS}
        # Constructed, not validated again: these fields were validated as settings (the
        # single-model form may run with no engines at all, and is then never ready).
        return (
            ModelSpec.model_construct(
                name=IMPLICIT_MODEL,
                aliases=(),
                upstream=None,
                router_kind=None,
                affinity_header=None,
                **fields,
            ),
        )

    def for_model(self, spec: ModelSpec) -> Settings:
        """The complete settings one model's services are built from: these, with the
        model's own fields and upstream in place. Validated field by field already (the
        spec) and as a whole (`_coherent`); the copy itself re-runs no validator."""
        if not self.models:
            return self
        update: dict[str, Any] = {f: getattr(spec, f) for f in PER_MODEL_FIELDS}
        update["upstream"] = spec.upstream or self.upstream
        update["router_kind"] = spec.router_kind or self.router_kind
        return self.model_copy(update=update)

    def clusters(self, spec: ModelSpec) -> tuple[UpstreamCluster, ...]:
        """The model's upstream clusters, each complete (its router kind in place): its
        `upstreams`, or the one implicit cluster (`IMPLICIT_CLUSTER`) of its router URL and
        engines, which is every config without `upstreams`."""
        router_kind = spec.router_kind or self.router_kind
        if spec.upstreams:
            return tuple(
                c
                if c.router_kind is not None
                else c.model_copy(update={"router_kind": router_kind})
                for c in spec.upstreams
            )
        # Constructed: the single-model form may run with no engines (never ready).
        return (
            UpstreamCluster.model_construct(
                name=IMPLICIT_CLUSTER,
                url=spec.upstream or self.upstream,
                engines=spec.engines,
                weight=1.0,
                router_kind=router_kind,
                budget_pool=None,
            ),
        )

    def for_cluster(self, spec: ModelSpec, cluster: UpstreamCluster) -> Settings:
        """The complete settings one cluster's monitor and budget are built from: the
        model's (`for_model`), with the cluster's engines, router and budget pool. The
        implicit cluster's are the model's own, unchanged."""
        ms = self.for_model(spec)
        if not spec.upstreams:
            return ms
        pool = cluster.budget_pool or f"{spec.budget_pool or spec.name}/{cluster.name}"
        return ms.model_copy(
            update={
                "engines": cluster.engines,
                "upstream": cluster.url,
                "router_kind": cluster.router_kind or ms.router_kind,
                "budget_pool": pool,
            }
        )

    def affinity_for(self, spec: ModelSpec) -> str | None:
        """The model's affinity header: its own, else the top-level one."""
        return spec.affinity_header or self.affinity_header

    def redis_password_value(self) -> str | None:
        """The Redis password from the file or the setting (the file wins); never logged."""
        if self.redis_password_file is not None:
            try:
                return self.redis_password_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(
                    f"invalid setting redis_password_file ({self.where('redis_password_file')}"
                    f"): cannot read it ({type(exc).__name__})"
                ) from None
        return None if self.redis_password is None else self.redis_password.get_secret_value()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    @property
    def admin_host_port(self) -> tuple[str, int]:
        return split_host_port(self.admin_listen)


# The config file of the `load_settings` call being resolved. pydantic-settings builds its
# sources per class, not per call, so the path reaches `_YamlSource` this way: scoped to the
# one call (a context variable, reset on return), never through the process environment.
_CONFIG_PATH: ContextVar[str | None] = ContextVar("kvproxy_config_path", default=None)


@contextmanager
def _config_path(path: str | os.PathLike[str] | None) -> Iterator[None]:
    token = _CONFIG_PATH.set(None if path is None else os.fspath(path))
    try:
        yield
    finally:
        _CONFIG_PATH.reset(token)


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file `load_settings(config_path=...)` names, else KVPROXY_CONFIG's."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = config_file()
        return {} if path is None else read_config_file(path)


def config_file() -> str | None:
    """The YAML file of the load being resolved: the one passed, else KVPROXY_CONFIG's."""
    return _CONFIG_PATH.get() or os.environ.get("KVPROXY_CONFIG") or None


def _yaml_error(path: str, exc: yaml.YAMLError) -> ConfigError:
    """A YAML syntax error as one line naming the file and line (PyYAML's own text names a
    `<unicode string>` and spans several lines)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path} line {mark.line + 1} column {mark.column + 1}" if mark else path
    what = " ".join(
        str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part
    )
    return ConfigError(f"config file {where}: {what or type(exc).__name__}")


def read_config_file(path: str) -> dict[str, Any]:
    """The config file's top-level mapping, keys lower-cased (ConfigError: one line)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return {str(k).lower(): v for k, v in data.items()}


def _yaml_line(path: str, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the deepest node of `loc` in the YAML file (None: not found)."""
    try:
        node: yaml.Node | None = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            hits = [(k, v) for k, v in node.value if str(k.value).lower() == str(part).lower()]
            if not hits:
                break
            line, node = hits[0][0].start_mark.line + 1, hits[0][1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


@dataclass(frozen=True)
class Origin:
    """The sources of one `load_settings` call, enough to say where a setting was given:
    the overrides' keys (flags), the config file; the environment is read when asked."""

    given: frozenset[str] = frozenset()
    config_path: str | None = None

    def env_name(self, key: str) -> str | None:
        """The environment variable actually set for `key` (any case, or nested with `__`)."""
        want = "KVPROXY_" + key.upper()
        for name in os.environ:
            upper = name.upper()
            if upper == want or upper.startswith(want + "__"):
                return name
        return None

    def describe(self, key: str, loc: Sequence[str | int] = ()) -> str:
        """Where `key` (the top-level setting; `loc` the full path within it) came from, by
        the sources' priority: flag, environment, config file; else its environment name."""
        if key in self.given:
            return f"--{key.replace('_', '-')}"
        env = self.env_name(key)
        if env is not None:
            return env
        if self.config_path is not None:
            try:
                in_file = key in read_config_file(self.config_path)
            except ConfigError:
                in_file = False
            if in_file:
                line = _yaml_line(self.config_path, loc or (key,))
                return f"{self.config_path} line {line}" if line else self.config_path
        return "KVPROXY_" + key.upper()


def _fields_at(loc: Sequence[str | int]) -> list[str]:
    """The keys valid where `loc` points: Settings' own at the top, else those of the nested
    model (an `engines` entry, a `models` entry, ...) the path leads to."""
    model: type[BaseModel] = Settings
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return []
        nested = [
            a
            for a in (info.annotation, *get_args(info.annotation))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not nested:
            return []
        model = nested[0]
    return list(model.model_fields)


def did_you_mean(key: str, loc: Sequence[str | int] = ()) -> str:
    """The suffix naming the closest valid key to a misspelt one (empty when none is close)."""
    close = difflib.get_close_matches(key.lower(), _fields_at(loc), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise ValueError(f"must be HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    **more: Any,
) -> Settings:
    """Build Settings or raise ConfigError with one readable line.

    `config_path`: the YAML file (`--config`); None reads the one KVPROXY_CONFIG names, if
    any. `overrides` (and keyword overrides, merged over them): values that win over the
    environment and the file, as CLI flags do; a None value means "not given". Reads the
    environment, never writes it: two loads in one process cannot see each other's file.

        load_settings(config_path="kvproxy.yaml", overrides={"max_context": 8192})
    """
    given = {k: v for k, v in {**(overrides or {}), **more}.items() if v is not None}
    with _config_path(config_path):
        origin = Origin(frozenset(given), config_file())
        try:
            settings = Settings(**given)
        except ValidationError as exc:
            raise _one_line(exc, origin) from None
        except SettingsError as exc:
            raise _env_error(exc, origin) from None
    settings._origin = origin
    return settings


def _one_line(exc: ValidationError, origin: Origin) -> ConfigError:
    """The first validation error as one line: the setting (its path), where it was given,
    what is wrong, and for an unknown key the closest valid one."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "settings"
    key = str(loc[0]) if loc else "settings"
    what = err["msg"]
    if err["type"] == "extra_forbidden" and loc:
        what = "unknown key" + did_you_mean(str(loc[-1]), loc[:-1])
    msg = f"invalid setting {path} ({origin.describe(key, loc)}): {what}"
    if len(exc.errors()) > 1:
        msg += f" (and {len(exc.errors()) - 1} more)"
    return ConfigError(redact(msg))


def _env_error(exc: SettingsError, origin: Origin) -> ConfigError:
    """pydantic-settings could not parse an environment value as JSON (a list or mapping
    setting such as KVPROXY_ENGINES): one line naming the variable and where JSON broke."""
    text = str(exc)
    key = text.split('"')[1] if text.count('"') >= 2 else "settings"
    cause = exc.__cause__
    detail = f": {cause}" if cause is not None else ""
    return ConfigError(
        redact(f"invalid setting {key} ({origin.describe(key)}): not valid JSON{detail}")
    )
