"""What ``paratrain graph`` shows of a ModelParallel job (``SPEC.graph``): each node's worker
and part, the workers of each subgraph (every replica of a replicated stage), the values that
cross workers with their shapes and bytes, named by the node of the *traced* graph computing
them (:func:`cut_origin`), the parameters each worker holds and, with tensor parallelism, the
pipeline x TP mesh.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ...comm.context import default_workers
from ...graph.partition import cut
from ...graph.sizes import count_elements, shape_info, tensor_at, tensor_metas
from ...graph.trace import module_of
from ...subgraphs import under
from ..spec import GraphView, Traced
from .plan import replicas_for
from .tp_stages import mesh_report, tp_size_of
from .validation import num_workers, plan_for

_ORIG = "paratrain_explain_node"  # fx node meta key: the node's name in the traced graph


def _output_nodes(module: fx.GraphModule, count: int) -> list[fx.Node | None]:
    """The nodes a part's submodule returns, in the order of its top-level outputs."""
    out = next(n for n in module.graph.nodes if n.op == "output")
    arg = out.args[0]
    items = list(arg) if isinstance(arg, list | tuple) and (count > 1 or len(arg) == 1) else [arg]
    return [a if isinstance(a, fx.Node) else None for a in items]


def cut_origin(gm: fx.GraphModule, plan: Any) -> tuple[dict[str, str], dict[str, int]]:
    """``plan.cut``'s value names -> the traced graph's node computing each (``add_1``, not
    ``getitem_k``), and each traced node -> its part: the cut made again over ``gm`` with its
    nodes tagged (fx copies node meta into the parts), used only if its parts are the plan's."""
    for n in gm.graph.nodes:
        n.meta[_ORIG] = n.name
    try:
        mine = cut(gm, plan.claims)
    except Exception as e:  # noqa: BLE001 - the report then shows the plan's own names
        logging.getLogger(__name__).info("graph: values named as the plan names them: %r", e)
        return {}, {}
    same = [(p.index, p.rank, p.inputs, p.outputs) for p in mine.parts] == [
        (p.index, p.rank, p.inputs, p.outputs) for p in plan.cut.parts]
    if not same:
        return {}, {}
    names: dict[str, str] = {}
    part_of: dict[str, int] = {}
    for p in mine.parts:
        for n in p.module.graph.nodes:
            if n.op not in ("placeholder", "output") and n.meta.get(_ORIG):
                part_of.setdefault(str(n.meta[_ORIG]), p.index)
        for value, node in zip(p.outputs, _output_nodes(p.module, len(p.outputs)), strict=False):
            if node is not None and node.meta.get(_ORIG):
                names[value] = str(node.meta[_ORIG])
    by_target = {str(n.target): n.name for n in gm.graph.nodes if n.op == "get_attr"}
    for a in mine.attrs:
        if a.target in by_target:
            names[a.name] = by_target[a.target]
    return names, part_of


class PlacementView(GraphView):
    """A ModelParallel job's placement in ``paratrain graph``'s report (module docstring)."""

    def __init__(self, traced: Traced) -> None:
        super().__init__()
        job = traced.job
        self.traced = traced
        # one worker a stage: a pipeline x TP job's stages run on tp processes each (tp_stages)
        self.workers = default_workers(num_workers(job), list(job.workers))
        self.plan = plan_for(job, traced.model, self.workers, traced.example)
        self.replicas = replicas_for(job, self.plan, len(self.workers))
        self.worker_id = {int(w.rank): str(w.id) for w in self.workers}
        self.origin, self.node_part = cut_origin(traced.gm, self.plan)
        self.held: dict[int, int] = {}  # parameter id -> rank
        self.node_of = {n.name: n for n in traced.gm.graph.nodes}

    def _name(self, rank: int) -> str:
        return self.worker_id.get(rank, f"rank {rank}")

    def _replicas_of(self, rank: int) -> list[str]:
        """Every worker running stage ``rank`` (itself first); one unless replicated."""
        return [self._name(r) for r in self.replicas.of(rank)]

    def node(self, path: str, how: str, node: Any, tensors: list[Any]) -> dict[str, Any]:
        """The node's rank, worker (and replicas) and part."""
        nodes, cut = self.traced.gm.graph.nodes, self.plan.cut
        out: dict[str, Any] = {}
        rank = self.plan.owner.get(path) if how == "leaf" else next(
            (cut.owner[m.name] for m in nodes if m.op != "get_attr"
             and m.name in cut.owner and module_of(m) == path), cut.owner.get(node.name))
        if rank is not None:
            out["rank"], out["worker"] = int(rank), self._name(int(rank))
            if len(self._replicas_of(int(rank))) > 1:
                out["replicas"] = self._replicas_of(int(rank))
            for t in tensors:
                self.held.setdefault(id(t), int(rank))
        part = next((p.index for p in cut.parts if path in p.nodes), None) if how == "leaf" else next(
            (self.node_part[m.name] for m in nodes if m.name in self.node_part and module_of(m) == path), None)
        if part is not None:
            out["part"] = part
        return out

    def group(self, path: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """A subgraph's ZeRO level (over a replicated stage's replicas) and its workers."""
        out: dict[str, Any] = {}
        subs = self.traced.subgraphs
        shard = str(getattr(subs[path], "shard", "none")) if path in subs else "none"
        if shard != "none":
            out["shard"] = shard
        inside = sorted({r["rank"] for r in rows if "rank" in r and under(r["node"], [path])})
        out["workers"] = [w for r in inside for w in self._replicas_of(r)]
        return out

    def sections(self) -> dict[str, Any]:
        """The mesh (with TP), the protocol, the transfers and the parameters per worker."""
        job, train = self.traced.job, self.traced.train
        report: dict[str, Any] = {}
        tp_size = tp_size_of(job)
        if tp_size > 1:  # pipeline (x replicas) x TP: the mesh (tp_stages)
            report["mesh"] = self._mesh(tp_size)
        strategy: Any = job.strategy
        report["protocol"] = str(strategy.communication.protocol)
        if report["protocol"] == "Pipeline":
            report["micro_batch_size"] = int(strategy.communication.micro_batch_size)
        for a in self.plan.cut.attrs:
            held_tensor = tensor_at(self.traced.model, a.target)
            if held_tensor is not None:
                self.held[id(held_tensor)] = int(a.rank)
        report["transfers"] = [self._transfer(tr) for tr in self.plan.cut.transfers]
        report["batch_rows"] = int(min(job.train.batch_size, len(train))) if train is not None else None
        report.update(self._per_worker())
        return report

    def _mesh(self, tp_size: int) -> dict[str, Any]:
        replicated = bool(self.replicas.groups)
        return {**mesh_report(self.replicas, num_workers(self.traced.job), tp_size),
                "note": f"worker-w (rank w above) runs on its tp group (ranks w*{tp_size} .. "
                        f"w*{tp_size}+{tp_size - 1}); the ranks of one tp index form a lane: a "
                        "whole pipeline" + (", a replicated stage's replicas taking their rows "
                                            "of each micro-batch; each dp group sums the "
                                            "gradients of one shard" if replicated else
                                            ", one rank a stage")}

    def _transfer(self, tr: Any) -> dict[str, Any]:
        """One value crossing workers: its ends, the traced node computing it, its shape."""
        cut, model = self.plan.cut, self.traced.model
        src_node = self.origin.get(tr.value)
        entry: dict[str, Any] = {"value": tr.value, "node": src_node or tr.value,
                                 "from": self._name(tr.src), "from_rank": tr.src,
                                 "to": self._name(tr.dst), "to_rank": tr.dst}
        kind_of, k = cut.producer.get(tr.value, ("part", -1))
        entry["produced_by"] = f"part {k}" if kind_of == "part" else kind_of
        if kind_of == "attr":
            entry["attr"] = {a.name: a.target for a in cut.attrs}.get(tr.value)
        fxn = self.node_of.get(src_node) if src_node else None
        if fxn is not None:
            entry["op"] = fxn.op
            entry["in_module"] = module_of(fxn) or ""
            metas = tensor_metas(fxn.meta.get("tensor_meta"))
            if kind_of == "attr" and not metas and entry.get("attr"):  # a tensor has a meta's fields
                metas = tensor_metas(tensor_at(model, str(entry["attr"])))
            shape, dtype, nbytes = shape_info(metas)
            if shape is not None:
                entry.update(shape=shape, dtype=dtype, bytes=nbytes)
        for end, rank in (("from", tr.src), ("to", tr.dst)):
            if len(self._replicas_of(rank)) > 1:  # cut by rows over the stage's replicas
                entry[f"{end}_replicas"] = self._replicas_of(rank)
        return entry

    def _per_worker(self) -> dict[str, Any]:
        """The parameters each worker holds, the loss's worker, the parameters never run."""
        cut, all_params = self.plan.cut, list(self.traced.model.parameters())
        per_rank: dict[int, list[torch.Tensor]] = {}
        by_id = {id(p): p for p in all_params}
        for pid, rank in self.held.items():
            if pid in by_id:
                per_rank.setdefault(rank, []).append(by_id[pid])
        workers = []
        for w in self.workers:
            stage, copy = self.replicas.logical(int(w.rank))
            entry: dict[str, Any] = {"worker": str(w.id), "rank": int(w.rank),
                                     "parameters": count_elements(per_rank.get(stage, [])),
                                     "parts": [p.index for p in cut.parts_of(stage)]}
            if self.replicas.count(stage) > 1:
                entry["replica"], entry["replicas"] = copy, self.replicas.count(stage)
                entry["replica_of"] = self._name(stage)
            workers.append(entry)
        out: dict[str, Any] = {"workers": workers, "loss_worker": self._name(cut.loss_rank)}
        unplaced = [p for p in all_params if id(p) not in self.held]
        if unplaced:
            out["parameters_not_run"] = count_elements(unplaced)
        return out
