"""What a job's model looks like as a graph: ``paratrain graph JOB`` (and ``validate --explain``).

:func:`explain` builds the job's model as its executor does (the task's model, seeded),
traces it (:func:`paratrain.graph.trace.trace` with ``model.leaf_modules``) and returns a
JSON-able report; :func:`render` turns it into text. The report lists:

- ``nodes``: the modules the forward runs, in execution order: every ``call_module`` of the
  trace, plus each module traced *into* that holds parameters or buffers of its own (a
  head computing ``F.linear(x, self.weight)``); each with its parameter count, its
  effective strategy (``[strategy]``, or the nearest ``[subgraphs]`` key above it:
  :func:`paratrain.subgraphs.effective_strategy`) and, under ModelParallel, its worker and
  part (:func:`paratrain.executors.model_parallel.validation.plan_for`);
- ``subgraphs``: the modules that have children, with their own strategy when the job sets
  one;
- under ModelParallel, ``transfers``: every value that crosses workers (its gradient goes
  back), named by the node of the *traced* graph that computes it (``add_1``, the residual
  stream; ``blocks_1_act``) rather than by ``split_module``'s ``getitem_k``, with its shape
  and bytes for one batch of ``train.batch_size`` training rows
  (:class:`torch.fx.passes.shape_prop.ShapeProp`); and the parameters each worker holds. A
  replicated stage (``[subgraphs.<path>]`` DataParallel under ModelParallel) lists every
  worker running it (:func:`paratrain.executors.model_parallel.replicas.replicas_for`).

Pure: no process is started, nothing is written. Every user error is a ConfigError.

The shapes are :mod:`.shapes`'s; the transfers' names in the traced graph :mod:`.origin`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..config import ConfigError
from ..graph.render import render  # re-exported: the report's text
from ..graph.trace import module_of, trace
from .origin import cut_origin
from .shapes import propagate, shape_info, tensor_metas

__all__ = ["explain", "explain_file", "render"]

def _type(strategy: Any) -> str:
    return str(getattr(strategy, "type", strategy))


def _build(job: Any) -> tuple[nn.Module, Any]:
    """The job's model and training set, as the executors build them (seeded)."""
    from ..task import resolve_task
    from ..training import seed_everything

    seed_everything(job.run.seed)
    task = resolve_task(job)
    try:
        train, _ = task.datasets(job.run.seed)
        model = task.build_model(job.model, train)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the job's own code: one line, no traceback
        first = (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
        raise ConfigError([("model", f"building the model failed: {first}")]) from None
    return model, train


def _params(module: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    return list(module.parameters(recurse=recurse))


def _tensor_at(model: nn.Module, target: str) -> torch.Tensor | None:
    """The parameter or buffer at dotted ``target`` of ``model`` (None if there is none)."""
    try:
        obj: Any = functools.reduce(getattr, target.split("."), model)
    except AttributeError:
        return None
    return obj if isinstance(obj, torch.Tensor) else None


def _count(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel()
    return total


def explain(job: Any, model: nn.Module | None = None, *, shapes: bool = True) -> dict[str, Any]:
    """The report of ``job``'s graph (see the module docstring). ``model``: the job's model
    already built (else built here); the job's ``run.imports`` must already be imported."""
    from ..subgraphs import check_pairings, check_paths, effective_strategy, resolve

    check_pairings(job)
    train = None
    if model is None or shapes:
        built, train = _build(job)
        model = built if model is None else model
    check_paths(model, job)
    leaves = tuple(getattr(job.model, "leaf_modules", ()) or ())
    example = None  # the model's arguments on two examples: torch.export where fx fails
    if train is not None:
        from ..executors.model_parallel.validation import example_args

        example = example_args(None, train)
    gm = trace(model, leaves, example)
    root = job.strategy
    resolved = resolve(model, job)  # patterns ("class:BatchNorm2d") as the modules they match
    subs: Mapping[str, Any] = resolved.table
    kind = _type(root)
    modules = dict(model.named_modules())

    shape_note = propagate(gm, job, train) if shapes and train is not None else None
    node_of = {n.name: n for n in gm.graph.nodes}

    plan = None
    replicas: Any = None
    workers: list[Any] = []
    if kind == "ModelParallel":
        from ..comm.context import default_workers
        from ..executors import spec_for
        from ..executors.model_parallel.validation import plan_for

        procs = spec_for(job).processes(job)[0]
        if job.tensor_parallel is not None and job.tensor_parallel.tensor_parallel_size > 1:
            procs //= job.tensor_parallel.tensor_parallel_size  # pipeline x TP: one worker a stage
        workers = default_workers(procs, list(job.workers))
        plan = plan_for(job, model, workers, example)
        from ..executors.model_parallel.replicas import replicas_for

        replicas = replicas_for(job, plan, len(workers), workers)
    worker_id = {int(w.rank): str(w.id) for w in workers}

    def replicas_of(rank: int) -> list[str]:
        """Every worker running stage ``rank`` (itself first); one unless replicated."""
        ranks = replicas.of(rank) if plan is not None else (rank,)
        return [worker_id.get(r, f"rank {r}") for r in ranks]

    def strategy_of(path: str) -> dict[str, Any]:
        eff = effective_strategy(path, subs, root)
        key = path if path in subs else None
        probe = path
        while key is None and "." in probe:
            probe = probe.rpartition(".")[0]
            key = probe if probe in subs else None
        return {"strategy": _type(eff),
                "strategy_from": f"subgraphs.{resolved.origin[key]}" if key else "strategy"}

    # nodes: call_module targets, and modules traced into that hold tensors of their own
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
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1

    origin: dict[str, str] = {}
    node_part: dict[str, int] = {}  # traced node name -> part index
    part_of: dict[str, int] = {}  # called module -> part index
    if plan is not None:
        origin, node_part = cut_origin(job, gm, plan, workers)
        for p in plan.cut.parts:
            for m in p.nodes:
                part_of.setdefault(m, p.index)
    held: dict[int, int] = {}  # parameter id -> rank
    rows: list[dict[str, Any]] = []
    for i, (path, how, n) in enumerate(order):
        mod = modules[path]
        tensors = _params(mod, recurse=(how == "leaf"))
        row: dict[str, Any] = {"index": i, "node": path, "module": type(mod).__name__, "kind": how,
                               "parameters": _count(tensors), **strategy_of(path)}
        if calls.get(path, 1) > 1:
            row["calls"] = calls[path]
        if plan is not None:
            rank = plan.owner.get(path) if how == "leaf" else next(
                (plan.cut.owner[m.name] for m in gm.graph.nodes if m.op != "get_attr"
                 and m.name in plan.cut.owner and module_of(m) == path), plan.cut.owner.get(n.name))
            if rank is not None:
                row["rank"], row["worker"] = int(rank), worker_id.get(int(rank), f"rank {rank}")
                if len(replicas_of(int(rank))) > 1:
                    row["replicas"] = replicas_of(int(rank))
                for t in tensors:
                    held.setdefault(id(t), int(rank))
            part = part_of.get(path) if how == "leaf" else next(
                (node_part[m.name] for m in gm.graph.nodes
                 if m.name in node_part and module_of(m) == path), None)
            if part is not None:
                row["part"] = part
        if shapes:
            shape, dtype, _ = shape_info(tensor_metas(n.meta.get("tensor_meta")))
            if shape is not None:
                row["output_shape"], row["dtype"] = shape, dtype
        rows.append(row)

    groups: list[dict[str, Any]] = []
    for path, mod in modules.items():
        if not path or not any(True for _ in mod.children()):
            continue
        g: dict[str, Any] = {"subgraph": path, "module": type(mod).__name__,
                             "parameters": _count(_params(mod)), **strategy_of(path)}
        if path in subs:
            g["own_strategy"] = _type(subs[path])
            shard = str(getattr(subs[path], "shard", "none"))
            if kind == "ModelParallel" and shard != "none":  # ZeRO over a replicated stage's replicas
                g["shard"] = shard
        if plan is not None:
            inside = sorted({r["rank"] for r in rows if "rank" in r
                             and (r["node"] == path or r["node"].startswith(path + "."))})
            g["workers"] = [w for r in inside for w in replicas_of(r)]
        groups.append(g)

    all_params = list(model.parameters())
    report: dict[str, Any] = {
        "model": type(model).__name__,
        "parameters": _count(all_params),
        "strategy": kind,
        "leaf_modules": list(leaves),
        "subgraph_strategies": {k: _type(v) for k, v in sorted(subs.items())},
        "nodes": rows,
        "subgraphs": groups,
    }
    if kind == "Federated":  # which path runs the rounds ([federated] runtime)
        from ..executors.federated.flower import describe_runtime

        report["runtime"] = describe_runtime(job)
    tp_size = job.tensor_parallel.tensor_parallel_size if job.tensor_parallel is not None else 1
    if kind == "ModelParallel" and tp_size > 1:  # pipeline (x replicas) x TP: the mesh (tp_stages)
        from ..executors.model_parallel.tp_stages import mesh_report
        from ..executors.model_parallel.validation import num_workers

        replicated = replicas is not None and bool(replicas.groups)
        report["mesh"] = {**mesh_report(replicas, num_workers(job), tp_size),
                          "note": f"worker-w (rank w above) runs on its tp group (ranks w*{tp_size} .. "
                                  f"w*{tp_size}+{tp_size - 1}); the ranks of one tp index form a lane: a "
                                  "whole pipeline" + (", a replicated stage's replicas taking their rows "
                                                      "of each micro-batch; each dp group sums the "
                                                      "gradients of one shard" if replicated else
                                                      ", one rank a stage")}
    if kind == "ModelParallel" and plan is not None:
        report["protocol"] = str(root.communication.protocol)
        if report["protocol"] == "Pipeline":
            report["micro_batch_size"] = int(root.communication.micro_batch_size)
        cut = plan.cut
        attr_target = {a.name: a.target for a in cut.attrs}
        for a in cut.attrs:
            held_tensor = _tensor_at(model, a.target)
            if held_tensor is not None:
                held[id(held_tensor)] = int(a.rank)
        transfers: list[dict[str, Any]] = []
        for tr in cut.transfers:
            src_node = origin.get(tr.value)
            entry: dict[str, Any] = {"value": tr.value, "node": src_node or tr.value,
                                     "from": worker_id.get(tr.src, f"rank {tr.src}"), "from_rank": tr.src,
                                     "to": worker_id.get(tr.dst, f"rank {tr.dst}"), "to_rank": tr.dst}
            kind_of, k = cut.producer.get(tr.value, ("part", -1))
            entry["produced_by"] = f"part {k}" if kind_of == "part" else kind_of
            if kind_of == "attr":
                entry["attr"] = attr_target.get(tr.value)
            fxn = node_of.get(src_node) if src_node else None
            if fxn is not None:
                entry["op"] = fxn.op
                entry["in_module"] = module_of(fxn) or ""
                shape, dtype, nbytes = shape_info(tensor_metas(fxn.meta.get("tensor_meta")))
                if kind_of == "attr" and shape is None and entry.get("attr"):
                    tensor = _tensor_at(model, str(entry["attr"]))
                    if tensor is not None:
                        shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
                        nbytes = tensor.numel() * tensor.element_size()
                if shape is not None:
                    entry.update(shape=shape, dtype=dtype, bytes=nbytes)
            for end, rank in (("from", tr.src), ("to", tr.dst)):
                if len(replicas_of(rank)) > 1:  # cut by rows over the stage's replicas
                    entry[f"{end}_replicas"] = replicas_of(rank)
            transfers.append(entry)
        report["transfers"] = transfers
        report["batch_rows"] = int(min(job.train.batch_size, len(train))) if train is not None else None
        per_rank: dict[int, list[torch.Tensor]] = {}
        by_id = {id(p): p for p in all_params}
        for pid, rank in held.items():
            if pid in by_id:
                per_rank.setdefault(rank, []).append(by_id[pid])
        report["workers"] = []
        for w in workers:
            stage, copy = replicas.logical(int(w.rank))
            entry = {"worker": str(w.id), "rank": int(w.rank),
                     "parameters": _count(per_rank.get(stage, [])),
                     "parts": [p.index for p in cut.parts_of(stage)]}
            if replicas.count(stage) > 1:
                entry["replica"], entry["replicas"] = copy, replicas.count(stage)
                entry["replica_of"] = worker_id.get(stage, f"rank {stage}")
            report["workers"].append(entry)
        report["loss_worker"] = worker_id.get(cut.loss_rank, f"rank {cut.loss_rank}")
        unplaced = [p for p in all_params if id(p) not in held]
        if unplaced:
            report["parameters_not_run"] = _count(unplaced)
    if shape_note is not None:
        report["shapes_unavailable"] = shape_note
    from ..executors import is_tensor_parallel

    if kind == "DataParallel" and getattr(root, "shard", "none") != "none" and not is_tensor_parallel(job):
        from ..executors.data_parallel.zero import shard_plan  # ZeRO: what is sharded
        from ..subgraphs import local_parameter_names

        report["shard"] = shard_plan(model, level=root.shard, units=root.shard_unit,
                                     local=local_parameter_names(model, job), world=root.num_replicas)
    if is_tensor_parallel(job):  # which modules tensor parallelism shards, and how
        from ..executors.tensor_parallel.runner import dry_run, mesh_plan

        report["tensor_parallel_size"] = job.tensor_parallel.tensor_parallel_size
        report["tensor_parallel"] = [{"module": p, "sharding": how} for p, how in dry_run(job)]
        mesh = mesh_plan(job)  # the dp x tp mesh; ZeRO runs over its dp columns
        if "shard" in mesh:
            report["shard"] = mesh.pop("shard")
        report["mesh"] = mesh
    return report


def explain_file(path: str | Path, *, shapes: bool = True) -> dict[str, Any]:
    """Load the job file (and its ``run.imports``, relative to its folder); its report."""
    from ..config.job import load_job
    from ..executors.custom import import_plugins

    job = load_job(path)
    try:
        import_plugins(list(job.run.imports), base=Path(path).resolve().parent)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the job's own code: one line, no traceback
        raise ConfigError([("run.imports", f"importing failed: {type(e).__name__}: {e}")]) from None
    report = explain(job, shapes=shapes)
    report["job"] = str(path)
    return report

