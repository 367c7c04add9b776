"""`kvproxy.tokens` by tier, as docs/architecture.md's tier table draws it: each tier a
subpackage with a face, imports between tiers only downwards and only through faces. Read
from the code's own imports (the same reading as tests/test_architecture.py)."""

from __future__ import annotations

import importlib
import re

import pytest
from test_architecture import DOC, REPO, imports, modules

TIER_ROW = re.compile(r"^\| `(kvproxy\.tokens\.[a-z_]+)` \| (\d) \|")
# The ladder (counter, ladder, the package's face and __main__) uses every tier.
LADDER_RANK = 9


def tier_map() -> dict[str, int]:
    return {
        m.group(1): int(m.group(2))
        for line in DOC.read_text(encoding="utf-8").splitlines()
        if (m := TIER_ROW.match(line))
    }


def tier(module: str) -> str | None:
    """The tier a kvproxy.tokens module belongs to; None for the ladder's modules."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["kvproxy", "tokens"]:
        return None
    if (REPO / "kvproxy" / "tokens" / parts[2]).is_dir():
        return ".".join(parts[:3])
    return None


def test_the_tiers_are_the_table() -> None:
    found = {t for m in modules() if (t := tier(m)) is not None}
    assert found == set(tier_map())


@pytest.mark.parametrize("name", sorted(tier_map()))
def test_each_tier_has_a_face_saying_what_it_decides(name: str) -> None:
    face = importlib.import_module(name)
    assert "decides" in (face.__doc__ or ""), f"{name} says what it decides"
    exported = getattr(face, "__all__", None)
    assert exported, f"{name}'s face names what the other tiers may import"
    for n in exported:
        assert hasattr(face, n), (name, n)


def wrong_imports(found: list[tuple[str, str, str]]) -> list[str]:
    ranks = tier_map()
    wrong = []
    for importer, module, name in found:
        if not importer.startswith("kvproxy.tokens"):
            continue
        here, there = tier(importer), tier(module)
        if there is None or here == there:
            continue
        rank_here = LADDER_RANK if here is None else ranks[here]
        if ranks[there] >= rank_here:
            wrong.append(f"{importer} -> {module} (rank {rank_here} -> {ranks[there]})")
        if module != there:
            wrong.append(f"{importer} imports {module}: not {there}'s face")
        if name.startswith("_"):
            wrong.append(f"{importer} takes the private {module}.{name}")
    return wrong


def test_tiers_import_downwards_through_faces() -> None:
    wrong = wrong_imports(imports())
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_up_or_past_a_face() -> None:
    assert wrong_imports(
        [
            ("kvproxy.tokens.bound.guarantee", "kvproxy.tokens.gate.features", "INERT_KEYS"),
            ("kvproxy.tokens.replica.frames", "kvproxy.tokens.bound", "bounds"),
            ("kvproxy.tokens.gate.verified", "kvproxy.tokens.replica", "_private"),
            ("kvproxy.tokens.counter", "kvproxy.tokens.exact", "Partial"),
            ("kvproxy.tokens.exact.local", "kvproxy.tokens.exact.fast", "x"),
        ]
    ) == [
        "kvproxy.tokens.bound.guarantee imports kvproxy.tokens.gate.features: "
        "not kvproxy.tokens.gate's face",
        "kvproxy.tokens.replica.frames -> kvproxy.tokens.bound (rank 1 -> 2)",
        "kvproxy.tokens.gate.verified -> kvproxy.tokens.replica (rank 1 -> 1)",
        "kvproxy.tokens.gate.verified takes the private kvproxy.tokens.replica._private",
    ]
