"""The model table: which model's policy a request is counted and admitted against.

Each configured model (kvproxy.config.models) gets a `ModelServices` bundle: its settings,
its own `CapacityMonitor` (its engines, measured and failing closed on their own), its
`TokenCounter` (its tokenizer and chat template) and its in-flight `Budget` (budgets belong
to an engine pool). `ModelTable.for_request` is the request path's one lookup.

Both configuration forms are one table (`Settings.model_table()`): the single-model form is
a table of one implicit model (`IMPLICIT_MODEL`) that is also the default. Resolution, by the
request body's top-level `model` string:
  - a name or alias of an entry picks it (exact, case-sensitive: smg matches worker model
    ids exactly too);
  - a request with no `model` (SGLang's /generate, /encode and /classify have none) or an
    unknown name gets the default model if there is one, else 404 `model_not_found`;
  - the implicit table answers every request with its one model without reading the body:
    there is nothing the body could change.
The body is never changed: the router picks the worker by the same field.

Cost: with a `models` list the body is parsed once here and once by `parse_request`; the
single-model form pays nothing.

Must never: admit a request against a model other than the one its `model` names (unless
the operator configured that fallback as `default_model`), or log the body (I8).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvproxy.budget import Budget, build_budget
from kvproxy.capacity import CapacityMonitor
from kvproxy.config import IMPLICIT_MODEL, Settings
from kvproxy.observe import UNKNOWN_MODEL
from kvproxy.policy import KvproxyError, errors
from kvproxy.prompt import load_json
from kvproxy.tokens import TokenCounter, build_counter


@dataclass(frozen=True)
class ModelServices:
    """Everything the request path needs for one model."""

    name: str
    aliases: tuple[str, ...]
    settings: Settings
    capacity: CapacityMonitor
    counter: TokenCounter
    budget: Budget

    @property
    def upstream(self) -> str:
        return self.settings.upstream

    def ready(self) -> bool:
        return self.capacity.ready() and not self.capacity.posture.blocks_ready()

    def capacity_json(self) -> dict[str, Any]:
        """Its engines, limits and budget (the single-model form's whole /capacity)."""
        return {**self.capacity.snapshot_json(), "budget": self.budget.describe_json()}

    def snapshot_json(self) -> dict[str, Any]:
        return {
            "aliases": list(self.aliases),
            "upstream": self.upstream,
            "tokenizer": self.counter.describe(),
            **self.capacity_json(),
        }


class ModelTable:
    """Resolution by name and the lifecycle of every model's services."""

    def __init__(
        self,
        models: Sequence[ModelServices],
        *,
        default_model: str | None = None,
        readiness: str = "any",
        implicit: bool = False,
    ) -> None:
        if not models:
            raise ValueError("a model table needs at least one model")
        if implicit and (len(models) != 1 or default_model != models[0].name):
            raise ValueError("the implicit table is one model, its own default")
        self.models = tuple(models)
        # The single-model form: nobody named the model, so messages and /capacity do not.
        self.implicit = implicit
        self.readiness = readiness
        self._by_name: dict[str, ModelServices] = {}
        for svc in models:
            for name in (svc.name, *svc.aliases):
                if name in self._by_name:
                    raise ValueError(f"model name or alias {name!r} is used twice")
                self._by_name[name] = svc
        self.default = None if default_model is None else self._by_name[default_model]

    @property
    def first(self) -> ModelServices:
        """The first configured model's services: the only one in the single-model form."""
        return self.models[0]

    @property
    def names(self) -> tuple[str, ...]:
        """Configured names (not aliases): the only values of a `model` metric label."""
        return tuple(m.name for m in self.models)

    def label(self, resolved: str | None) -> str:
        """The `model` metric label for a request resolved to `resolved` (None: to none,
        e.g. a pass-through or refused route: the implicit table's one model answers every
        request, so even those carry its name)."""
        if resolved is not None:
            return resolved
        return self.models[0].name if self.implicit else UNKNOWN_MODEL

    def resolve(self, name: str | None) -> ModelServices | None:
        """The model a request naming `name` is admitted against, None: no such model."""
        if name is not None:
            found = self._by_name.get(name)
            if found is not None:
                return found
        return self.default

    def for_request(self, body: bytes) -> ModelServices | KvproxyError:
        """The request path's one lookup (a counted route's decoded body)."""
        if self.implicit:
            return self.models[0]
        try:
            data = load_json(body)
        except KvproxyError as err:
            return err  # the same 400 parse_request would give
        raw = data.get("model")
        if raw is not None and not isinstance(raw, str):
            return errors.invalid_request("model must be a string", "model")
        found = self.resolve(raw)
        if found is None:
            return errors.model_not_found(raw, self.names)
        return found

    def ready(self) -> bool:
        """/readyz: any model ready (default) or all of them (`readiness: all`)."""
        states = [m.ready() for m in self.models]
        return all(states) if self.readiness == "all" else any(states)

    def not_ready_reason(self) -> str:
        if self.implicit:
            m = self.models[0]
            if not m.capacity.ready():
                return "capacity unknown"
            return "engine posture (posture_action)"
        down = [m.name for m in self.models if not m.ready()]
        return f"capacity unknown for {', '.join(down)} (readiness: {self.readiness})"

    def snapshot_json(self) -> dict[str, Any]:
        """/capacity: the one model's snapshot, or grouped by model (one model's engines and
        limits say nothing about another's)."""
        if self.implicit:
            return self.models[0].capacity_json()
        return {
            "readiness": self.readiness,
            "models": {m.name: m.snapshot_json() for m in self.models},
        }

    def unknown_why(self, model: ModelServices) -> str:
        """Why a request of `model` is refused with 503 capacity_unknown (I3)."""
        why = "no fresh measurement"
        if not self.implicit:
            why += f" of model {model.name}'s engines"  # the others may be serving
        return why

    async def start(self) -> None:
        for m in self.models:
            await m.capacity.start()
            await m.budget.start()

    def reject_waiting(self) -> None:
        for m in self.models:
            m.budget.reject_waiting()

    async def stop_capacity(self) -> None:
        await asyncio.gather(*(m.capacity.stop() for m in self.models))

    async def aclose(self) -> None:
        """Budgets and counters, after the last request is gone."""
        for m in self.models:
            await m.budget.aclose()
            await m.counter.aclose()


async def build_table(
    settings: Settings,
    metrics: Any,
    session: Any,
    *,
    counter: TokenCounter | None = None,
) -> ModelTable:
    """Every model's services, in configured order. `counter` (tests) replaces the first
    model's. A tokenizer that cannot be loaded raises ConfigError after closing the
    counters already built."""
    built: list[ModelServices] = []
    counters: list[TokenCounter] = []
    try:
        for i, spec in enumerate(settings.model_table()):
            name = spec.name
            ms = settings.for_model(spec)
            metrics.add_model(name)
            c = counter if (i == 0 and counter is not None) else build_counter(ms, session=session)
            counters.append(c)
            built.append(
                ModelServices(
                    name=name,
                    aliases=spec.aliases,
                    settings=ms,
                    # After the counter: a start that fails on the tokenizer says only
                    # that, not the posture line the monitor logs when it is built.
                    capacity=CapacityMonitor(ms, metrics, model=name, verifier=c.verifier),
                    counter=c,
                    budget=build_budget(ms, metrics, name),
                )
            )
    except BaseException:
        for c in counters:
            if c is not counter:
                await c.aclose()
        raise
    implicit = not settings.models
    return ModelTable(
        built,
        default_model=IMPLICIT_MODEL if implicit else settings.default_model,
        readiness=settings.readiness,
        implicit=implicit,
    )
