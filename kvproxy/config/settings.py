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

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
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

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str = Field(min_length=1, max_length=64)
    markers: tuple[str, ...] = ()
    # Regular expressions, e.g. "KVCANARY-acme-[0-9a-f]{16}".
    patterns: tuple[str, ...] = ()


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
    )

    # --- network -------------------------------------------------------------------------
    listen: str = "0.0.0.0:8080"
    admin_listen: str = "0.0.0.0:9090"
    upstream: str = "http://127.0.0.1:8000"
    # Request bodies: 1M-token prompts are ~4-16 MiB of JSON; 32 MiB leaves room.
    max_body_bytes: int = Field(default=32 * MIB, ge=1024)
    # A client must deliver its whole body within this time (slowloris guard).
    body_read_timeout_s: float = Field(default=60.0, gt=0)
    # ...and each request head within this time: a connection's first within this time of
    # connecting, every later one on a kept-alive connection within this time of its first
    # byte (nginx's client_header_timeout).
    header_read_timeout_s: float = Field(default=30.0, gt=0)
    # A kept-alive public connection with no request for this long is closed (nginx's
    # keepalive_timeout is 75 s; shorter here because an idle socket holds a connection
    # slot, though the connection limit closes the longest idle one before it sheds).
    keepalive_timeout_s: float = Field(default=30.0, gt=0)
    # A request head (request line and header lines) past either bound gets 431 and is never
    # forwarded. Envoy's defaults (max_request_headers_kb 60, max_headers_count 100); aiohttp
    # refuses a line over 8,190 bytes or more than 128 fields by itself (400).
    max_request_head_bytes: int = Field(default=60 * 1024, ge=1024)
    max_request_headers: int = Field(default=100, ge=1, le=128)
    # X-Forwarded-For gets the peer's address appended. Set, the number of proxies in front
    # of kvproxy that append to it: only their addresses are kept (0: only the peer's, and
    # the client's Forwarded / X-Real-IP / X-Forwarded-* are dropped). docs/routes.md "Headers".
    forwarded_trusted_hops: int | None = Field(default=None, ge=0, le=16)
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    # Worst time between two upstream reads: a 1M-token prefill can take minutes before the
    # first byte; the router sends nothing meanwhile.
    upstream_read_timeout_s: float = Field(default=900.0, gt=0)
    # Shorter than the router's idle keep-alive so we never POST on a connection the router
    # is closing (aiohttp does not retry a POST that hit ServerDisconnectedError).
    upstream_keepalive_s: float = Field(default=15.0, gt=0)
    upstream_max_connections: int = Field(default=1024, ge=1)
    # The longest the router may take no request-body bytes (nginx's proxy_send_timeout).
    upstream_send_timeout_s: float = Field(default=60.0, gt=0)
    # An upstream response head (status line, header lines, interim heads) past either bound
    # is a 502. Envoy's defaults (60 KiB, 100 fields); a router's head is under 1 KiB.
    upstream_max_head_bytes: int = Field(default=60 * 1024, ge=1024)
    upstream_max_headers: int = Field(default=100, ge=1)
    # Gateway mode (`upstreams`): a cluster whose router refused a connection or answered
    # 5xx gets no request for this long while another cluster fits it, doubling per
    # consecutive ejection up to the max (Envoy's outlier detection: base_ejection_time 30 s,
    # max_ejection_time 300 s; shorter here because the capacity probes watch the engines
    # too, and a cluster of one router has no other host to absorb its share).
    upstream_eject_s: float = Field(default=10.0, gt=0)
    upstream_eject_max_s: float = Field(default=120.0, gt=0)
    # Outlier detection (kvproxy.policy.routing.Outliers; docs/gateway.md "Passive health").
    # A cluster is ejected after this many consecutive failures (connect failures, resets
    # or closes before a response head, head timeouts, 5xx heads the request did not cause;
    # a 5xx counts once per tenant in a streak). Envoy's consecutive_5xx: 5.
    upstream_outlier_consecutive: int = Field(default=5, ge=1)
    # The largest share of a model's clusters ejected at once; one may always be, never the
    # last (Envoy's max_ejection_percent is 10 % with at least one host).
    upstream_outlier_max_ejected_share: float = Field(default=0.5, gt=0, le=1)
    # The success-rate window, and the healthy time that lowers the ejection back-off level
    # by one (Envoy's interval: 10 s).
    upstream_outlier_interval_s: float = Field(default=10.0, gt=0)
    # Success-rate ejection: a cluster with at least this many outcomes in the window whose
    # success rate is more than the margin below its siblings' mean (each with as many).
    upstream_outlier_success_rate_min_requests: int = Field(default=20, ge=1)
    upstream_outlier_success_rate_margin: float = Field(default=0.3, gt=0, le=1)
    # The header whose value is hashed over a model's candidate clusters (rendezvous
    # hashing: a conversation keeps its prefix cache); a models entry may name its own.
    affinity_header: str | None = Field(default=None, pattern=HEADER_NAME_PATTERN)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # Overload shedding (kvproxy.serve.overload), both answered 503 `overloaded`. Public
    # connections open at once; 0 derives it from the soft fd limit (an upstream connection
    # per public one, 64 descriptors kept for the rest).
    max_connections: int = Field(default=0, ge=0)
    # Bytes of request bodies being read or counted at once (counting multiplies a body's
    # memory: JSON, the rendered chat, the tokenizer's encoding). At least max_body_bytes;
    # 48 MiB is one largest body and room for 4 MB prompts to be counted 4 at a time.
    max_body_memory_bytes: int = Field(default=48 * MIB, ge=1024)
    # How long a body waits for room before its 503 (queued, first come first served).
    body_memory_wait_s: float = Field(default=5.0, ge=0)

    # --- capacity (the engines and declared context: ModelFields) -------------------------
    capacity_refresh_s: float = Field(default=10.0, gt=0)
    capacity_stale_s: float = Field(default=60.0, gt=0)
    capacity_probe_timeout_s: float = Field(default=5.0, gt=0)
    limit_margin_tokens: int = Field(default=0, ge=0)

    # --- engine posture (kvproxy.posture) ---------------------------------------------------
    # The operator's own advisories (same schema as the shipped table), entries accepted by
    # id (listed in /capacity, the release record and the start log), and whether an active
    # unaccepted high-severity finding takes the proxy out of rotation (/readyz 503).
    advisories_file: str | None = None
    accept_advisories: tuple[str, ...] = ()
    posture_action: Literal["warn", "not_ready"] = "warn"

    # --- tokens and admission (the tokenizer and chat template: ModelFields) -------------
    # What sits between kvproxy and the engines: it decides which request features the
    # exact count is verified for (kvproxy.tokens.verified). auto probes the upstream
    # (kvproxy.capacity.router); until that succeeds, only what holds behind every router
    # is verified. A models entry may name its own.
    router_kind: RouterSetting = "auto"
    count_timeout_s: float = Field(default=10.0, gt=0)
    # What counts an `hf:` tokenizer. fastokens: ~20x faster exact counts of long prompts,
    # its tables ~120 MB resident for Qwen-3 once it has encoded; hf: HF tokenizers alone,
    # ~60 MB for the same tokenizer (a sidecar under a 150 MB memory limit), every exact
    # count ~20x slower (bench/RESULTS.md, Memory). Both count the same (the start-up check
    # holds fastokens to HF; HF is the reference).
    tokenizer_backend: Literal["fastokens", "hf"] = "fastokens"
    # Counts at once: one per core this process may use, at most 2. Measured on one core
    # (bench/PROFILE-LONG.md): a second count thread there doubled the CPU per 100k-token
    # prompt at concurrency 16 (8.8-9.2 ms vs 4.8-5.5 ms) and tripled its p99.
    count_concurrency: int = Field(default_factory=lambda: min(2, usable_cpus()), ge=1)
    image_tokens: int = Field(default=16384, ge=0)
    audio_tokens: int = Field(default=16384, ge=0)
    decode_policy: Literal["reject", "clamp"] = "reject"
    # Output assumed when a request names no max_tokens (decode needs room for >= 1 token).
    default_output_tokens: int = Field(default=1, ge=1)

    # --- deferred cancellation -----------------------------------------------------------
    drain_until: Literal["first_token", "completion"] = "first_token"
    # SGLang's bootstrap/waiting timeouts are 300 s: after that the engine has given up the
    # transfer itself, so waiting longer buys nothing and shorter may cut a live transfer.
    drain_timeout_s: float = Field(default=300.0, gt=0)
    # The budget's size and pool: ModelFields.
    queue_timeout_s: float = Field(default=30.0, ge=0)
    queue_max_waiters: int = Field(default=1024, ge=0)
    # Where the budget lives. local: this replica alone (N replicas may over-commit N-fold);
    # redis: one budget for every replica in front of the same engines (kvproxy.budget.cluster).
    budget_backend: Literal["local", "redis"] = "local"
    # redis://, rediss:// (TLS) or unix://. May carry a password; it is never logged.
    redis_url: SecretStr | None = None
    # The password apart from the URL: a file (a mounted Secret) or KVPROXY_REDIS_PASSWORD.
    redis_password_file: Path | None = None
    redis_password: SecretStr | None = None
    redis_tls_ca_file: Path | None = None
    redis_key_prefix: str = Field(default="kvproxy:budget", min_length=1)
    # A dead replica's leases come back after this long; live ones are renewed every third.
    redis_lease_ttl_s: float = Field(default=15.0, ge=0.3)
    # A Redis call slower than this counts as Redis unavailable.
    redis_timeout_s: float = Field(default=0.5, gt=0)
    redis_unavailable: Literal["local_share", "reject"] = "local_share"
    # local_share enforces budget / this on each replica while Redis is unavailable.
    budget_expected_replicas: int = Field(default=1, ge=1)

    # --- tenants and canaries ------------------------------------------------------------
    tenant_header: str = "X-Tenant-ID"
    trust_tenant_header: bool = False
    # bearer-token -> tenant map; tokens never appear in logs or labels.
    tenant_tokens: dict[str, str] = Field(default_factory=dict)
    tenant_hash_salt: str = "kvproxy"
    canaries: tuple[CanaryTenant, ...] = ()
    canary_action: Literal["block", "observe"] = "block"

    # --- routes --------------------------------------------------------------------------
    # Extra routes forwarded WITHOUT counting ("/path", "GET /path", "GET,HEAD /prefix/*"),
    # on top of the built-in ones clients need (/health, /v1/models, tokenize): the
    # upstreams' metrics, load, server info and admin routes only when listed here. Their
    # bodies reach the upstream unexamined: list only routes that cannot carry a prompt to a
    # KV cache (kvproxy.policy.routes).
    passthrough_routes: tuple[str, ...] = ()

    # --- several models (kvproxy.config.models) ------------------------------------------
    # Empty: the settings above are one model that matches every name (the single-model
    # form). Otherwise each entry owns its engines, tokenizer, template, limits and budget,
    # and a request is counted and admitted against the entry its `model` names.
    models: tuple[ModelSpec, ...] = ()
    # The entry for a request that names no model (SGLang /generate has no `model` field)
    # or a name no entry matches; unset, those get 404 model_not_found.
    default_model: str | None = None
    # /readyz with several models. any: ready while at least one model has fresh capacity
    # (the others answer 503 capacity_unknown per request); all: ready only when every
    # model has (one model's outage takes every model out of the Service).
    readiness: Literal["any", "all"] = "any"

    # --- logging -------------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = True

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
                    f"invalid setting redis_password_file (KVPROXY_REDIS_PASSWORD_FILE): "
                    f"cannot read it ({type(exc).__name__})"
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
        path = _CONFIG_PATH.get() or os.environ.get("KVPROXY_CONFIG")
        if not path:
            return {}
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config file {path}: {exc}".replace("\n", " ")) from exc
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        return {str(k).lower(): v for k, v in data.items()}


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
    try:
        with _config_path(config_path):
            return Settings(**given)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "settings"
        env = "KVPROXY_" + loc.split(".")[0].upper()
        # redact: a refused URL is quoted without its password or token.
        msg = redact(f"invalid setting {loc} ({env}): {err['msg']}")
        if len(exc.errors()) > 1:
            msg += f" (and {len(exc.errors()) - 1} more)"
        raise ConfigError(msg) from None
