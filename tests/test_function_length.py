"""No function in ``src/paratrain`` is over 80 lines (an AST scan: ``def`` line to last line,
docstring included): a longer one is split along its concepts."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
LIMIT = 80


def long_functions(root: Path = SRC, limit: int = LIMIT) -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    out[f"{path.relative_to(root).as_posix()}::{node.name}"] = length
    return out


def test_no_function_is_over_80_lines() -> None:
    found = long_functions()
    assert not found, f"functions over {LIMIT} lines: split them along concepts: {found}"


def test_the_scan_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path) == {"m.py::f": LIMIT + 1}
