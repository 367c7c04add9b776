"""The `models` setting: several models behind one kvproxy, each with its own policy.

A `ModelSpec` is what one entry of `models:` may say: the name clients send in `model`,
aliases, the engines that serve it (the same specs and discovery as the single-model
`engines`), its tokenizer and chat template, its declared context, its in-flight budget and
optionally its own upstream. `model_settings` turns each entry into a complete `Settings`
(the top level with the entry's fields in place), so the capacity monitor, the token counter
and the budget are built for a model exactly as they are built for the single-model form.

Why the single-model fields are refused next to `models` instead of inherited: a tokenizer,
a pool or a budget belongs to one model's engines. Inheriting the top-level tokenizer into a
model that uses another one would count its prompts with the wrong vocabulary, which is an
I1 risk, not a convenience. So each entry states its own, and an entry that states no
tokenizer gets `auto`: its own engines' `/tokenize` (the model's own tokenizer), or the byte
bound, which holds for any tokenizer, when its engines are static (config.effective_tokenizer).

Must never: let two entries answer to one name (a request would be counted against a pool
chosen by accident).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvproxy.config import EngineSpec, RouterSetting, check_tokenizer, check_upstream

if TYPE_CHECKING:
    from kvproxy.config import Settings

# Names travel in metric labels and logs: bounded length, no whitespace or control bytes.
NAME_PATTERN = r"^[^\s\x00-\x1f]{1,128}$"

# Single-model settings that belong to one model's engines; with `models` they go in the
# entries (see the module docstring for why they are not inherited).
PER_MODEL_FIELDS = (
    "engines",
    "tokenizer",
    "chat_template",
    "max_context",
    "max_inflight_prompt_tokens",
    "max_inflight_requests",
    "capacity_fallback_limit_tokens",
    "budget_pool",
)


class ModelSpec(BaseModel):
    """One entry of `models:`; every field but `name` and `engines` has the single-model
    default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    aliases: tuple[str, ...] = ()
    engines: tuple[EngineSpec, ...] = Field(min_length=1)
    tokenizer: str = "auto"
    chat_template: str | None = None
    max_context: int | None = Field(default=None, ge=1)
    max_inflight_prompt_tokens: int | None = Field(default=None, ge=1)
    max_inflight_requests: int | None = Field(default=None, ge=1)
    capacity_fallback_limit_tokens: int | None = Field(default=None, ge=1)
    # The Redis budget's pool: one per engine pool, so by default the model's name.
    budget_pool: str | None = Field(default=None, min_length=1, max_length=128)
    # Its own router; unset: the top-level `upstream` (one router serving every model).
    upstream: str | None = None
    # What that router is; unset: the top-level `router_kind`.
    router_kind: RouterSetting | None = None

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import re

        for alias in v:
            if not re.match(NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} must be 1-128 characters, no whitespace")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        return check_tokenizer(v)

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        return None if v is None else check_upstream(v)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def check_models(s: Settings) -> None:
    """The cross-entry rules (raised as ValueError: load_settings makes it one line)."""
    if not s.models:
        if s.default_model is not None:
            raise ValueError("default_model needs a models list")
        return
    mixed = [f for f in PER_MODEL_FIELDS if f in s.model_fields_set]
    if mixed:
        raise ValueError(
            f"{', '.join(mixed)} cannot be set next to models: set them in each models entry"
        )
    owner: dict[str, str] = {}
    for spec in s.models:
        for name in spec.names:
            if name in owner:
                other = owner[name]
                where = "twice in models" if other == spec.name else f"by {other} and {spec.name}"
                raise ValueError(f"model name or alias {name!r} is used {where}")
            owner[name] = spec.name
    if s.default_model is not None and s.default_model not in owner:
        raise ValueError(f"default_model {s.default_model!r} names no models entry")


def model_settings(s: Settings) -> list[tuple[ModelSpec | None, Settings]]:
    """Each model's complete settings, in configured order. The single-model form is one
    entry whose spec is None (it matches every name)."""
    if not s.models:
        return [(None, s)]
    out: list[tuple[ModelSpec | None, Settings]] = []
    for spec in s.models:
        update = {f: getattr(spec, f) for f in PER_MODEL_FIELDS}
        update["budget_pool"] = spec.budget_pool or spec.name
        update["upstream"] = spec.upstream or s.upstream
        update["router_kind"] = spec.router_kind or s.router_kind
        # Validated field by field above (ModelSpec) and as a whole by check_models; the
        # copy itself re-runs no validator.
        out.append((spec, s.model_copy(update=update)))
    return out
