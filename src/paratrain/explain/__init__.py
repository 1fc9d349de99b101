"""What a job's model looks like as a graph: ``paratrain graph JOB`` (and ``validate --explain``).

:func:`explain` builds the job's model as its executor does (seeded), traces it with
``model.leaf_modules`` and returns a JSON-able report (:func:`render`: its text): ``nodes``,
the modules the forward runs in execution order, each with its parameter count, effective
strategy and output shape (ShapeProp over one training batch); ``subgraphs``, the modules
that have children; then what the job's executor adds (``ExecutorSpec.graph``). Pure: no
process starts, nothing is written; every user error is a ConfigError.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..graph.draw import node_edges
from ..graph.render import render as render  # re-exported: the report's text
from ..graph.sizes import count_elements, shape_info, tensor_metas
from ..graph.trace import module_of, trace
from ..subgraphs import strategy_type


def _build(job: Any) -> tuple[nn.Module, Any]:
    """The job's model and training set, as the executors build them (seeded)."""
    from ..task import job_model
    from ..training import seed_everything

    seed_everything(job.run.seed)
    _, train, _, model = job_model(job)
    return model, train


def explain(job: Any, model: nn.Module | None = None, *, shapes: bool = True,
            edges: bool = False) -> dict[str, Any]:
    """The report of ``job``'s graph (see the module docstring). ``model``: the job's model
    already built (else built here); the job's ``run.imports`` must already be imported.
    ``edges``: also the data flow between the nodes (``edges``, :func:`..graph.draw.node_edges`)
    that ``paratrain graph --out`` draws."""
    from ..executors import Traced, spec_for
    from ..subgraphs import check_pairings, check_paths, resolve
    from ..task.steps import example_args

    check_pairings(job)
    train = None
    if model is None or shapes:
        built, train = _build(job)
        model = built if model is None else model
    check_paths(model, job)
    leaves = tuple(getattr(job.model, "leaf_modules", ()) or ())
    # the model's arguments on two examples: torch.export traces where fx fails
    example = example_args(None, train) if train is not None else None
    gm = trace(model, leaves, example)
    resolved = resolve(model, job)  # patterns ("class:BatchNorm2d") as the modules they match
    shape_note = _propagate(gm, job, train) if shapes and train is not None else None
    view = spec_for(job).graph(Traced(job, model, gm, train, example, resolved.table))
    modules = dict(model.named_modules())
    rows = []
    calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    for i, (path, how, n) in enumerate(_execution_order(gm, modules)):
        tensors = list(modules[path].parameters(recurse=(how == "leaf")))
        row: dict[str, Any] = {"index": i, "node": path, "module": type(modules[path]).__name__,
                               "kind": how, "parameters": count_elements(tensors),
                               **_strategy_of(path, resolved, job.strategy)}
        if calls.get(path, 1) > 1:
            row["calls"] = calls[path]
        row.update(view.node(path, how, n, tensors))
        if shapes:
            shape, dtype, _ = shape_info(tensor_metas(n.meta.get("tensor_meta")))
            if shape is not None:
                row["output_shape"], row["dtype"] = shape, dtype
        rows.append(row)
    report: dict[str, Any] = {
        "model": type(model).__name__,
        "parameters": count_elements(list(model.parameters())),
        "strategy": strategy_type(job.strategy),
        "leaf_modules": list(leaves),
        "subgraph_strategies": {k: strategy_type(v) for k, v in sorted(resolved.table.items())},
        "nodes": rows,
        "subgraphs": _subgraphs(modules, resolved, job.strategy, view, rows),
        **view.sections(),
    }
    if shape_note is not None:
        report["shapes_unavailable"] = shape_note
    if edges:
        report["edges"] = node_edges(gm, [r["node"] for r in rows])
    return report


def _propagate(gm: fx.GraphModule, job: Any, train: Any) -> str | None:
    """ShapeProp over one training batch (``meta['tensor_meta']`` on every node); the reason
    when it could not run: shapes are extra information only, left out then."""
    from torch.fx.passes.shape_prop import ShapeProp

    from ..task import fetch_batch, model_args

    try:
        rows = max(1, min(int(job.train.batch_size), len(train)))
        batch = fetch_batch(train, torch.arange(rows))
        args, kwargs = model_args(None, batch)
        if kwargs:  # ShapeProp feeds placeholders positionally only
            return "the model takes keyword arguments (a dict batch): shapes left out"
        with torch.no_grad():
            ShapeProp(gm).propagate(*args)
    except Exception as e:  # noqa: BLE001 - shapes are extra information only
        return (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
    return None


def _execution_order(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> list[tuple[str, str, fx.Node]]:
    """``(path, how, node)`` of the modules the forward runs, in order: call_module targets
    (``"leaf"``), and modules traced into that hold tensors of their own (``"traced"``)."""
    order: list[tuple[str, str, fx.Node]] = []
    seen: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "call_module":
            path = str(n.target)
            if path not in seen:
                seen.add(path)
                order.append((path, "leaf", n))
        elif n.op not in ("placeholder", "output"):
            path = module_of(n) or ""
            if path and path not in seen and path in modules:
                own = list(modules[path].parameters(recurse=False)) + list(modules[path].buffers(recurse=False))
                if own:
                    seen.add(path)
                    order.append((path, "traced", n))
    return order


def _strategy_of(path: str, resolved: Any, root: Any) -> dict[str, Any]:
    """The effective strategy at ``path`` and where it comes from (``strategy`` or the
    ``[subgraphs]`` key of the nearest ancestor that has one)."""
    from ..subgraphs import effective_strategy, nearest_ancestor

    key = path if path in resolved.table else nearest_ancestor(path, resolved.table)
    return {"strategy": strategy_type(effective_strategy(path, resolved.table, root)),
            "strategy_from": f"subgraphs.{resolved.origin[key]}" if key else "strategy"}


def _subgraphs(modules: dict[str, nn.Module], resolved: Any, root: Any, view: Any,
               rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The modules that have children, with their own strategy where the job sets one."""
    groups: list[dict[str, Any]] = []
    for path, mod in modules.items():
        if not path or not any(True for _ in mod.children()):
            continue
        g: dict[str, Any] = {"subgraph": path, "module": type(mod).__name__,
                             "parameters": count_elements(list(mod.parameters())),
                             **_strategy_of(path, resolved, root)}
        if path in resolved.table:
            g["own_strategy"] = strategy_type(resolved.table[path])
        g.update(view.group(path, rows))
        groups.append(g)
    return groups


def explain_file(path: str | Path, *, shapes: bool = True, edges: bool = False) -> dict[str, Any]:
    """Load the job file (and its ``run.imports``, relative to its folder); its report."""
    from ..config.job import load_job
    from ..executors import import_plugins

    job = load_job(path)
    import_plugins(list(job.run.imports), base=Path(path).resolve().parent)
    report = explain(job, shapes=shapes, edges=edges)
    report["job"] = str(path)
    return report

