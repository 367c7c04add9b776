"""The house as docs/architecture.md draws it: its packages, their layers and faces, no
import circles, no private names across packages. Read from the code's own imports."""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(kvproxy\.[a-z_]+)` \| (\d) \|")


def package_map() -> dict[str, int]:
    return {
        m.group(1): int(m.group(2))
        for line in DOC.read_text(encoding="utf-8").splitlines()
        if (m := ROW.match(line))
    }


# Cached: the circle check asks for every import (the tree walked afresh each time made
# `test_no_import_circles` the fast suite's third-slowest test, 47 s on a loaded machine).
@functools.cache
def modules() -> dict[str, Path]:
    out = {}
    for p in (REPO / "kvproxy").rglob("*.py"):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def top(module: str) -> str:
    return ".".join(module.split(".")[:2])


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imports() -> list[tuple[str, str, str]]:
    """(importer, imported module, name) for every kvproxy import, however nested (function
    bodies and TYPE_CHECKING blocks included: an import is an arrow wherever it stands)."""
    mods = modules()
    out = []
    for mod, path in mods.items():
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvproxy"):
                assert node.module is not None
                for alias in node.names:
                    out.append((mod, node.module, alias.name))
            elif isinstance(node, ast.Import):
                out += [(mod, a.name, "") for a in node.names if a.name.startswith("kvproxy")]
    return out


def defining_module(module: str, name: str) -> str:
    """Where `from module import name` really comes from: a submodule, or the module a
    package's face takes the name from."""
    mods = modules()
    if f"{module}.{name}" in mods:
        return f"{module}.{name}"
    path = mods[module]
    if path.name == "__init__.py":
        for node in _parsed(path).body:
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module != module
                and any((a.asname or a.name) == name for a in node.names)
            ):
                return defining_module(node.module, name)
    return module


def test_the_packages_are_the_map() -> None:
    documented = set(package_map())
    found = {top(m) for m in modules() if m not in ("kvproxy", "kvproxy.__main__")}
    assert found == documented
    # At most 16 top-level modules and packages, __init__ and __main__ included.
    assert len(found) + 2 <= 16


@pytest.mark.parametrize("package", sorted(p for p in package_map() if p != "kvproxy.cli"))
def test_each_package_has_a_face_naming_what_it_exports(package: str) -> None:
    face = importlib.import_module(package)
    assert face.__doc__, f"{package} says what it owns"
    names = getattr(face, "__all__", None)
    assert names, f"{package}'s face names what others may import"
    for name in names:
        assert hasattr(face, name), (package, name)


def test_imports_run_down_the_layers_through_faces_without_private_names() -> None:
    layers = package_map()
    wrong = []
    for importer, module, name in imports():
        here, there = top(importer), top(module)
        if here == there or there == "kvproxy" or here in ("kvproxy", "kvproxy.__main__"):
            continue
        if layers[there] > layers[here]:
            wrong.append(f"{importer} -> {module} (layer {layers[here]} -> {layers[there]})")
        if module != there:
            wrong.append(f"{importer} imports {module}: not {there}'s face")
        if name.startswith("_") or any(p.startswith("_") for p in module.split(".")):
            wrong.append(f"{importer} takes the private {module}.{name}")
    assert not wrong, "\n".join(wrong)


def test_no_circle_between_packages() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for importer, module, _ in imports():
        here, there = top(importer), top(module)
        if here != there and there != "kvproxy" and here not in ("kvproxy", "kvproxy.__main__"):
            edges[here].add(there)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            t == goal or (t not in seen and reaches(t, goal, seen | {t}))
            for t in edges.get(start, ())
        )

    circles = sorted(p for p in edges if reaches(p, p, {p}))
    assert not circles, f"packages in an import circle: {circles}"


def test_no_import_circles() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for importer, module, name in imports():
        target = defining_module(module, name) if name else module
        if target != importer and target in modules():
            edges[importer].add(target)
    # A face hands names on; the arrow is to the module that defines them.
    for m in list(edges):
        edges[m] = {t for t in edges[m] if modules()[t].name != "__init__.py"}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if seen.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in seen:
                visit(t)
        stack.pop()
        seen[m] = 2

    for m in sorted(modules()):
        if m not in seen:
            visit(m)
