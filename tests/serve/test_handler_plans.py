"""The handler's plans as docs/architecture.md and the handler's docstring show them:
rendered from `PLANS` (`describe_plans`), so the doc fails here when it drifts."""

from __future__ import annotations

import re
from pathlib import Path

from kvproxy.serve import handler

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
BLOCK = re.compile(r"<!-- BEGIN plans:[^\n]*-->\n```\n(.*?)```\n<!-- END plans -->", re.S)


def test_architecture_doc_shows_the_plans_the_handler_runs() -> None:
    found = BLOCK.search(DOC.read_text())
    assert found is not None, "docs/architecture.md lost its plans block"
    expected = handler.describe_plans() + "\n"
    assert found.group(1) == expected, f"paste into docs/architecture.md:\n{expected}"


def rows(text: str) -> dict[str, list[str]]:
    """A description's rows: label -> stage names (a row continues on indented lines)."""
    out: dict[str, list[str]] = {}
    label = ""
    for line in text.splitlines():
        if not line.startswith(" "):
            label, _, line = line.partition("  ")
            out[label] = []
        out[label] += line.split()
    return out


def test_the_description_names_every_stage_of_every_plan_in_order() -> None:
    shown = rows(handler.describe_plans())
    first = [s.__name__ for s in handler.EVERY_REQUEST]
    assert shown["every request"] == first
    assert shown["counted routes +"] == [
        "require_post", "decode_body", "pick_model", "admit", "body_counted",
        "pick_cluster", "take_budget", "recheck_after_queue", "clamp",
    ]  # fmt: skip
    for label, plan in handler.PLANS:
        names = [stage.__name__ for stage, _ in plan]
        if names[: len(first)] == first:
            assert shown[f"{label} +"] == (names[len(first) :] or ["(nothing)"])
        else:
            assert shown[label] == names
    assert handler.__doc__ is not None
    assert handler.describe_plans(indent=8) in handler.__doc__


def test_every_plan_the_handler_picks_is_described() -> None:
    described = {id(plan) for _, plan in handler.PLANS}
    for plan in (handler.COUNTED, handler.PASSTHROUGH, handler.REFUSED, handler.RETRY):
        assert id(plan) in described
