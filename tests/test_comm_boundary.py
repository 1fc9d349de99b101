"""Only ``paratrain.comm`` touches torch.distributed (DESIGN §1).

Walks every module of ``src/paratrain`` outside ``comm/`` with :mod:`ast` and reports any
import of ``torch.distributed`` (``import torch.distributed``, ``from torch.distributed
... import``, ``from torch import distributed``, ``importlib.import_module("torch.
distributed...")``) and any ``torch.distributed`` attribute access, except under
``if TYPE_CHECKING:`` (type-only imports are fine).
"""

from __future__ import annotations

import ast
from pathlib import Path

import paratrain

PKG = Path(paratrain.__file__).resolve().parent
DIST = "torch.distributed"


def _is_dist(module: str | None) -> bool:
    return module is not None and (module == DIST or module.startswith(DIST + "."))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def violations(source: str, filename: str = "<src>") -> list[str]:
    """``line: what`` for each use of torch.distributed in ``source``."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.orelse:
                visit(stmt)
            return
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found.extend(f"{line}: import {a.name}" for a in node.names if _is_dist(a.name))
        elif isinstance(node, ast.ImportFrom):
            if _is_dist(node.module):
                found.append(f"{line}: from {node.module} import ...")
            elif node.module == "torch" and any(a.name == "distributed" for a in node.names):
                found.append(f"{line}: from torch import distributed")
        elif isinstance(node, ast.Attribute) and _dotted(node) == DIST:
            found.append(f"{line}: torch.distributed attribute")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("importlib.import_module", "import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_dist(arg.value):
                    found.append(f"{line}: {name}({arg.value!r})")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, filename=filename))
    return found


def test_detector_finds_every_form_and_skips_type_checking() -> None:
    src = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed import ReduceOp\n"
        "from torch import distributed\n"
        "import importlib\n"
        "x = importlib.import_module('torch.distributed.rpc')\n"
        "def f():\n"
        "    return torch.distributed.get_rank()\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import torch.distributed as tdist\n"
        "    from torch.distributed import ProcessGroup\n"
        "s = 'torch.distributed is mentioned in a string only'\n"
    )
    assert [v.split(":")[0] for v in violations(src)] == ["2", "3", "4", "6", "8"]
    assert violations("import torch\nfrom torch import nn\nx = torch.nn.Linear(1, 1)\n") == []


def test_only_comm_calls_torch_distributed() -> None:
    bad: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "comm":
            continue
        bad += [f"src/paratrain/{rel.as_posix()}:{v}" for v in violations(path.read_text(), str(path))]
    assert not bad, "torch.distributed outside paratrain.comm:\n" + "\n".join(bad)
