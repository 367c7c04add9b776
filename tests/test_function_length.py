"""No function in kvproxy/ is longer than 120 lines: past that a function is a table, a
sequence of named steps or several functions in disguise (decorators not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvproxy"
MAX_LINES = 120


def long_functions(root: Path, max_lines: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > max_lines:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_bound() -> None:
    assert long_functions(PACKAGE, MAX_LINES) == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}")
    assert long_functions(tmp_path, MAX_LINES) == [
        f"{tmp_path.name}/m.py:5 long ({MAX_LINES + 1} lines)"
    ]
