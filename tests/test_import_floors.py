"""The floors of the package (pyproject.toml ``[tool.importlinter]``, listed in README
"Layout") are enforced by the suite: no import runs back up a floor, no import cycle between
the modules of any package, no executor imports another (their shared parts are
``executors.shared``), the floors above the executors reach them through
``paratrain.executors`` only, and no module names a floor above its own in a string (a
by-name import through ``importlib`` that import-linter cannot see)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter.application.use_cases import read_user_options
from importlinter.configuration import configure
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.independence import IndependenceContract
from importlinter.contracts.layers import LayersContract

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "paratrain"
PYPROJECT = ROOT / "pyproject.toml"


def _contract_options(contract_id: str) -> tuple[dict, dict]:
    """(session options, the contract's options) as ``lint-imports`` reads them."""
    configure()  # import-linter's adapters (what its command line sets up)
    opts = read_user_options(str(PYPROJECT))
    found = [dict(c) for c in opts.contracts_options if c.get("id") == contract_id]
    assert found, f"no contract with id {contract_id!r} in pyproject.toml"
    return dict(opts.session_options), found[0]


def _floors() -> dict[str, int]:
    """Top-level module of paratrain -> its floor (0 = the bottom)."""
    _, floors = _contract_options("floors")
    layers = list(floors["layers"])
    out: dict[str, int] = {}
    for height, layer in enumerate(reversed(layers)):
        for name in re.split(r"[|:]", layer):
            out[name.strip()] = height
    return out


def test_lint_imports_keeps_every_contract() -> None:
    """What ``make lint`` runs: every contract (floors, cycles, executors, specs), on today's tree."""
    exe = Path(sys.executable).parent / "lint-imports"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    proc = subprocess.run([*cmd, "--no-cache", "--no-logo", str(PYPROJECT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("paratrain", cache_dir=None)


def test_an_import_running_up_a_floor_breaks_the_contract(graph: grimp.ImportGraph) -> None:
    session, options = _contract_options("floors")
    contract = LayersContract(name="floors", session_options=session, contract_options=options)
    assert contract.check(graph, verbose=False).kept
    copy = deepcopy(graph)
    copy.add_import(importer="paratrain.config.job", imported="paratrain.training.rundir",
                    line_number=1, line_contents="from ..training.rundir import run_dir_of")
    assert not contract.check(copy, verbose=False).kept
    # siblings on one floor marked independent (`|`) do not import each other either
    copy = deepcopy(graph)
    copy.add_import(importer="paratrain.data.datasets", imported="paratrain.graph.trace",
                    line_number=1, line_contents="from ..graph.trace import trace")
    assert not contract.check(copy, verbose=False).kept


def test_a_cycle_between_sibling_modules_breaks_the_contract(graph: grimp.ImportGraph) -> None:
    session, options = _contract_options("cycles")
    contract = AcyclicSiblingsContract(name="cycles", session_options=session,
                                       contract_options=options)
    assert contract.check(graph, verbose=False).kept
    assert graph.direct_import_exists(importer="paratrain.comm.launch",
                                      imported="paratrain.comm.forkserver")
    copy = deepcopy(graph)
    copy.add_import(importer="paratrain.comm.forkserver", imported="paratrain.comm.launch",
                    line_number=1, line_contents="from .launch import launch")
    assert not contract.check(copy, verbose=False).kept


@pytest.mark.parametrize(("contract_id", "kind", "importer", "imported"), [
    # an executor imports another (shared parts belong to executors.shared)
    ("executors", IndependenceContract, "paratrain.executors.tensor_parallel.runner",
     "paratrain.executors.data_parallel.runner"),
    # a floor above the executors reaches past their specs into a strategy's modules
    ("specs", ForbiddenContract, "paratrain.explain", "paratrain.executors.model_parallel.validation"),
])
def test_an_executor_import_across_the_specs_breaks_the_contract(
        graph: grimp.ImportGraph, contract_id: str, kind: Any, importer: str, imported: str) -> None:
    session, options = _contract_options(contract_id)
    contract = kind(name=contract_id, session_options=session, contract_options=options)
    assert contract.check(graph, verbose=False).kept
    copy = deepcopy(graph)
    copy.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    assert not contract.check(copy, verbose=False).kept


def test_every_top_level_module_has_a_floor() -> None:
    floors = _floors()
    modules = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert modules == set(floors), "add new top-level modules to [tool.importlinter] layers"
    assert floors["config"] == 0 and floors["cli"] == max(floors.values())


# ------------------------------------------------------------- by-name imports

_MODULE_NAME = re.compile(r"paratrain((?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?")


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def upward_names(module: str, source: str, floors: dict[str, int]) -> list[str]:
    """The string constants of ``module`` (``paratrain.<top>...``) that are a module name
    (``paratrain.x.y`` or ``paratrain.x.y:attr``, what ``importlib`` or a launcher would
    import) on a floor above ``module``'s own; docstrings and messages are prose."""
    own = floors[module.split(".")[1]]
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
            continue
        m = _MODULE_NAME.fullmatch(node.value)
        if m is None:
            continue
        top = m.group(1).split(".")[1]
        if floors.get(top, -1) > own:
            found.append(f"{module}:{node.lineno} names {node.value!r} (floor {floors[top]} > {own})")
    return found


def test_no_module_names_a_floor_above_its_own() -> None:
    floors = _floors()
    problems: list[str] = []
    seen = 0
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        if len(parts) < 2:
            continue  # paratrain/__init__.py sits on no floor (the package's face)
        seen += 1
        problems += upward_names(".".join(parts), path.read_text(), floors)
    assert seen > 100 and not problems, "\n".join(problems)


def test_the_by_name_check_sees_an_importlib_string() -> None:
    floors = _floors()
    src = ('"""Names paratrain.worker in prose only."""\nimport importlib\n'
           'ENTRY = "paratrain.worker:worker_entry"\n'
           'importlib.import_module("paratrain.executors.local")\n'
           'MSG = "see paratrain.cli for the command"\n')
    got = upward_names("paratrain.comm.launch", src, floors)
    assert len(got) == 2 and "'paratrain.worker:worker_entry'" in got[0], got
    # from dispatch, a floor above the executors, naming them is fine (the worker is not)
    from_dispatch = upward_names("paratrain.dispatch", src, floors)
    assert len(from_dispatch) == 1 and "paratrain.worker" in from_dispatch[0], from_dispatch
