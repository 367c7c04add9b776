"""The reference tables that would drift if written by hand, made from the code.

- docs/configuration.md, "Every setting": one row per `Settings` field (and per field of an
  `engines`, `models`, `upstreams` and `canaries` entry), from the fields' docstrings,
  defaults and constraints.
- docs/errors.md, "Every error code": one row per code kvproxy can answer, from the
  constructors in kvproxy/policy/errors.py (status and code, read from their source) and
  `CLIENT_GUIDE` (when, and what the client should do).

Each table sits between `<!-- BEGIN name (make docs) -->` and `<!-- END name -->` markers;
the prose around it is kept. `make docs` (`python -m kvproxy.config.doctables`) rewrites
them; `--check` changes nothing and exits 1 naming what is stale or undocumented (the test
suite runs it). A field without a docstring, or a code without a `CLIENT_GUIDE` entry, is
an error, not an empty cell.

Must never: import anything that needs the network or a tokenizer (it runs in `make docs`).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvproxy.config.models import EngineSpec, ModelFields, ModelSpec, UpstreamCluster
from kvproxy.config.settings import CanaryTenant, Settings
from kvproxy.policy import errors

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION_MD = REPO / "docs" / "configuration.md"
ERRORS_MD = REPO / "docs" / "errors.md"
MIB = 1024 * 1024


class DocError(Exception):
    """Something the tables need is missing from the code (one line, naming it)."""


# --- settings -------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """A docstring as one Markdown table cell: one line, pipes escaped."""
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def _default(name: str, info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "doc_default" in extra:
        return str(extra["doc_default"])
    if info.default_factory is not None:
        if info.default_factory in (dict, list, tuple):
            value: Any = info.default_factory()
        else:
            raise DocError(
                f"setting {name}: a computed default needs "
                "json_schema_extra={'doc_default': '...'} saying what it is"
            )
    else:
        value = info.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        for unit, size in (("MiB", MIB), ("KiB", 1024)):
            if value % size == 0:
                return f"{value // size} {unit}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "`[]`" if not value else f"`{list(value)}`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def _literals(annotation: Any) -> list[str]:
    """The values of a Literal (or an optional Literal, or an alias of one)."""
    if get_origin(annotation) is Literal:
        return [str(v) for v in get_args(annotation)]
    for arg in get_args(annotation):
        found = _literals(arg)
        if found:
            return found
    return []


def _values(info: FieldInfo) -> str:
    """What a field accepts, where the type says more than its name: the choices of a
    Literal, the bounds of a number or length."""
    choices = _literals(info.annotation)
    if choices:
        return " \\| ".join(f"`{c}`" for c in choices)
    bounds = []
    for m in info.metadata:
        for cls, attr, sign in (
            (annotated_types.Ge, "ge", "≥"),
            (annotated_types.Gt, "gt", ">"),
            (annotated_types.Le, "le", "≤"),
            (annotated_types.Lt, "lt", "<"),
        ):
            if isinstance(m, cls):
                bounds.append(f"{sign} {getattr(m, attr):g}")
        if isinstance(m, annotated_types.MinLen) and m.min_length > 0:
            bounds.append(f"≥ {m.min_length} long")
        if isinstance(m, annotated_types.MaxLen):
            bounds.append(f"≤ {m.max_length} long")
    return ", ".join(bounds)


@dataclass(frozen=True)
class FieldRow:
    key: str
    env: str | None
    default: str
    values: str
    doc: str


def field_rows(
    model: type[BaseModel], prefix: str = "", env: bool = False, skip: frozenset[str] = frozenset()
) -> list[FieldRow]:
    """One row per field of `model`, in declaration order; DocError for a field without a
    docstring (pydantic's `use_attribute_docstrings` makes it the description)."""
    rows = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        if not info.description:
            raise DocError(
                f"setting {prefix}{name} ({model.__name__}) has no docstring: add one under "
                "the field, it is the documentation"
            )
        rows.append(
            FieldRow(
                key=f"{prefix}{name}",
                env=f"KVPROXY_{name.upper()}" if env else None,
                default=_default(name, info),
                values=_values(info),
                doc=_cell(info.description),
            )
        )
    return rows


def _table(rows: list[FieldRow]) -> list[str]:
    out = ["| setting | default | accepts | what it does |", "|---|---|---|---|"]
    for r in rows:
        key = f"`{r.key}`" + (f"<br>`{r.env}`" if r.env else "")
        out.append(f"| {key} | {r.default} | {r.values} | {r.doc} |")
    return out


def settings_table() -> str:
    own = frozenset(ModelFields.model_fields)
    lines = [
        "Made by `make docs` from the fields' docstrings in `kvproxy/config/settings.py` and",
        "`kvproxy/config/models.py`; edit those, not this table. The environment variable is",
        "`KVPROXY_` and the key in capitals (`__` for nesting); lists and maps are JSON there.",
        "",
        *_table(field_rows(Settings, env=True)),
        "",
        "An entry of `engines` (also inside a `models` entry or an `upstreams` cluster):",
        "",
        *_table(field_rows(EngineSpec, "engines[].")),
        "",
        "An entry of `models` has the model's own keys above (`engines`, `max_context`,",
        "`capacity_fallback_limit_tokens`, `tokenizer`, `chat_template`, `max_inflight_*`,",
        "`budget_pool`, `upstreams`) and these:",
        "",
        *_table(field_rows(ModelSpec, "models[].", skip=own)),
        "",
        "An entry of `upstreams` (gateway mode, [gateway](gateway.md)):",
        "",
        *_table(field_rows(UpstreamCluster, "upstreams[].")),
        "",
        "An entry of `canaries`:",
        "",
        *_table(field_rows(CanaryTenant, "canaries[].")),
    ]
    return "\n".join(lines)


# --- client error codes ---------------------------------------------------------------------


def emitted_codes(source: str | None = None) -> dict[str, list[int]]:
    """Every error code kvproxy/policy/errors.py can produce, with its statuses, in source
    order, read from the source itself: each call with `status=` and `code=` literals
    (the constructors), and each `(status, code, ...)` tuple literal (the upstream table).
    A new constructor is found without being registered anywhere."""
    tree = ast.parse(source if source is not None else inspect.getsource(errors))
    found: dict[str, list[int]] = {}

    def add(status: ast.expr | None, code: ast.expr | None) -> None:
        if not (isinstance(status, ast.Constant) and isinstance(code, ast.Constant)):
            return
        if isinstance(status.value, int) and isinstance(code.value, str):
            statuses = found.setdefault(code.value, [])
            if status.value not in statuses:
                statuses.append(status.value)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords}
            add(kw.get("status"), kw.get("code"))
        elif isinstance(node, ast.Tuple) and len(node.elts) >= 2:
            first = node.elts[0]
            is_int = isinstance(first, ast.Constant) and isinstance(first.value, int)
            if is_int and 100 <= first.value <= 599:  # type: ignore[attr-defined]
                add(first, node.elts[1])
    # ast.walk is breadth-first: order the rows as the codes appear in the file.
    text = source if source is not None else inspect.getsource(errors)
    return dict(sorted(found.items(), key=lambda kv: text.find(f'"{kv[0]}"')))


def errors_table() -> str:
    codes = emitted_codes()
    missing = [c for c in codes if c not in errors.CLIENT_GUIDE]
    if missing:
        raise DocError(
            f"error code {', '.join(missing)} has no CLIENT_GUIDE entry in "
            "kvproxy/policy/errors.py (when it is answered, what the client should do)"
        )
    stale = [c for c in errors.CLIENT_GUIDE if c not in codes]
    if stale:
        raise DocError(f"CLIENT_GUIDE documents {', '.join(stale)}, which nothing produces")
    lines = [
        "Made by `make docs` from `kvproxy/policy/errors.py` (the constructors and",
        "`CLIENT_GUIDE`); edit those, not this table.",
        "",
        "| code | HTTP | when | what the client should do |",
        "|---|---|---|---|",
    ]
    for code, statuses in codes.items():
        guide = errors.CLIENT_GUIDE[code]
        status = ", ".join(str(s) for s in statuses)
        lines.append(f"| `{code}` | {status} | {_cell(guide.when)} | {_cell(guide.action)} |")
    return "\n".join(lines)


# --- the files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    path: Path
    name: str
    make: Callable[[], str]


TABLES = (
    Table(CONFIGURATION_MD, "settings", settings_table),
    Table(ERRORS_MD, "errors", errors_table),
)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN {name} (make docs) -->", f"<!-- END {name} -->"


def rendered(text: str, table: Table) -> str:
    """`text` with the table between its markers replaced (DocError: markers missing)."""
    begin, end = _markers(table.name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise DocError(f"{table.path.name}: no '{begin}' ... '{end}' block for the table")
    return text[: start + len(begin)] + "\n" + table.make() + "\n" + text[stop:]


def stale_tables(tables: tuple[Table, ...] = TABLES) -> Iterator[str]:
    """What `--check` reports: each file whose table differs from the code's."""
    for table in tables:
        text = table.path.read_text(encoding="utf-8")
        if rendered(text, table) != text:
            yield f"{table.path.relative_to(REPO)}: the {table.name} table is stale (make docs)"


def main(
    argv: list[str] | None = None,
    tables: tuple[Table, ...] = TABLES,
    prog: str = "python -m kvproxy.config.doctables",
    description: str | None = __doc__,
) -> int:
    """`make docs` for `tables` (a higher layer passes its own: `python -m kvproxy.tokens`)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = p.parse_args(argv)
    try:
        if args.check:
            stale = list(stale_tables(tables))
            for line in stale:
                print(line, file=sys.stderr)
            return 1 if stale else 0
        for table in tables:
            text = table.path.read_text(encoding="utf-8")
            new = rendered(text, table)
            if new != text:
                table.path.write_text(new, encoding="utf-8")
                print(f"wrote {table.path.relative_to(REPO)} ({table.name})")
    except DocError as exc:
        print(f"make docs: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
