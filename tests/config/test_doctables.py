"""The generated reference tables (kvproxy.config.doctables): every setting and every client
error code is documented, and the committed docs are what `make docs` makes of the code."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import typing
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel, ConfigDict, Field

from kvproxy.config import Settings, doctables
from kvproxy.config.doctables import DocError, emitted_codes, errors_table, field_rows
from kvproxy.policy import errors


def test_committed_docs_are_what_make_docs_makes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvproxy.config.doctables", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_setting_is_in_configuration_md() -> None:
    text = doctables.CONFIGURATION_MD.read_text(encoding="utf-8")
    missing = [
        f for f in Settings.model_fields if f"| `{f}`<br>`KVPROXY_{f.upper()}` |" not in text
    ]
    assert missing == []
    # The ones the hand-written table had left out, by name.
    for name in ("limit_margin_tokens", "tenant_hash_salt", "decode_policy", "access_log"):
        assert f"`{name}`" in text


def test_a_setting_without_a_docstring_fails_the_docs() -> None:
    class Documented(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        said: int = 1
        """What it does."""
        unsaid: int = Field(default=2, ge=0)

    with pytest.raises(DocError, match=r"setting unsaid \(Documented\) has no docstring"):
        field_rows(Documented)


def test_a_computed_default_must_say_what_it_is() -> None:
    class Computed(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        cpus: int = Field(default_factory=lambda: 3)
        """Counted at start."""

    with pytest.raises(DocError, match="cpus: a computed default needs"):
        field_rows(Computed)
    # Settings' own computed default says it (the machine's CPUs must not leak into docs).
    [row] = [r for r in field_rows(Settings) if r.key == "count_concurrency"]
    assert row.default == "usable CPUs, at most 2"


def _sample(annotation: Any) -> Any:
    """An argument of the annotated type for calling a constructor."""
    samples: dict[Any, Any] = {bool: True, int: 7, float: 1.5, str: "x"}
    if annotation in samples:
        return samples[annotation]
    origin = get_origin(annotation)
    if origin is tuple:
        return ()
    if origin is list:
        return ["x"]
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in get_args(annotation) if a is not type(None)))
    raise AssertionError(f"no sample for {annotation}")


def constructed_codes() -> dict[str, set[int]]:
    """Ground truth apart from the table's source scan: call every constructor in
    kvproxy/policy/errors.py (each function returning an error) and read what it built."""
    found: dict[str, set[int]] = {}
    hints_ns = vars(errors)
    for name, fn in inspect.getmembers(errors, inspect.isfunction):
        if fn.__module__ != errors.__name__:
            continue
        hints = typing.get_type_hints(fn, hints_ns)
        returns = hints.get("return")
        if not (isinstance(returns, type) and issubclass(returns, errors.KvproxyError)):
            continue
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty
        ]
        kinds = get_args(errors.NetworkKind) if name == "upstream_failure" else (None,)
        for kind in kinds:
            args = [kind if kind else _sample(hints[p.name]) for p in params]
            err = fn(*args)
            found.setdefault(err.code, set()).add(err.status)
    return found


def test_every_code_a_constructor_builds_is_found_by_the_scan() -> None:
    built = constructed_codes()
    scanned = {code: set(statuses) for code, statuses in emitted_codes().items()}
    assert {"inflight_budget_exceeded", "token_count_unavailable", "request_timeout"} <= set(built)
    assert {"malformed_request", "method_not_allowed", "unsupported_content_encoding"} <= set(built)
    assert built == scanned


def test_every_code_is_in_errors_md_with_its_status() -> None:
    text = doctables.ERRORS_MD.read_text(encoding="utf-8")
    for code, statuses in constructed_codes().items():
        row = f"| `{code}` | {', '.join(str(s) for s in sorted(statuses))} |"
        assert row in text, code


def test_a_new_code_without_a_guide_fails_the_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    source = inspect.getsource(errors) + (
        "\n\ndef teapot() -> KvproxyError:\n"
        '    return KvproxyError(status=418, code="teapot", reason="teapot", message="no")\n'
    )
    assert emitted_codes(source)["teapot"] == [418]
    monkeypatch.setattr(doctables, "emitted_codes", lambda: emitted_codes(source))
    with pytest.raises(DocError, match="error code teapot has no CLIENT_GUIDE entry"):
        errors_table()
    guide = {k: v for k, v in errors.CLIENT_GUIDE.items() if k != "overloaded"}
    monkeypatch.setattr(doctables, "emitted_codes", emitted_codes)
    monkeypatch.setattr(errors, "CLIENT_GUIDE", guide)
    with pytest.raises(DocError, match="error code overloaded has no CLIENT_GUIDE entry"):
        errors_table()


def test_check_reports_a_stale_table(tmp_path: Any) -> None:
    doc = tmp_path / "errors.md"
    doc.write_text(
        "# x\n<!-- BEGIN errors (make docs) -->\nold\n<!-- END errors -->\n", encoding="utf-8"
    )
    table = doctables.Table(doc, "errors", errors_table)
    text = doc.read_text(encoding="utf-8")
    assert doctables.rendered(text, table) != text
    assert doctables.rendered(doctables.rendered(text, table), table) == doctables.rendered(
        text, table
    )
