"""Under ModelParallel, the values that cross workers named by the *traced* graph: which
node of the traced model computes each top-level value of the plan's cut (``add_1``, the
residual stream; ``blocks_1_act``, not ``split_module``'s ``getitem_k``), and which part
each traced node runs in.

:func:`cut_origin` makes the cut again over the traced graph with every node tagged by its
name (fx copies node meta into the parts) and uses it only when it has the plan's parts
exactly; otherwise the report shows the plan's own names.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

__all__ = ["cut_origin"]

_ORIG = "paratrain_explain_node"  # fx node meta key: the node's name in the traced graph


def _output_nodes(module: fx.GraphModule, count: int) -> list[fx.Node | None]:
    """The nodes a part's submodule returns, in the order of its top-level outputs."""
    out = next(n for n in module.graph.nodes if n.op == "output")
    arg = out.args[0]
    items = list(arg) if isinstance(arg, list | tuple) and (count > 1 or len(arg) == 1) else [arg]
    return [a if isinstance(a, fx.Node) else None for a in items]


def _claims(job: Any, workers: list[Any]) -> dict[str, int]:
    from ...comm.workers import resolve_rank

    claims: dict[str, int] = {}
    for i, part in enumerate(job.strategy.partitions):
        rank = resolve_rank(part.target, workers, field=f"strategy.partitions[{i}].target")
        for node in part.node_ids:
            claims.setdefault(node, rank)
    return claims


def cut_origin(job: Any, gm: fx.GraphModule, plan: Any,
               workers: list[Any]) -> tuple[dict[str, str], dict[str, int]]:
    """``plan.cut``'s top-level value names -> the traced graph's node computing each, and
    each traced node -> the index of the part it runs in.

    The cut is made again over ``gm`` with every node tagged by its name (fx copies node
    meta into the parts); used only when it has the plan's parts exactly."""
    from ...graph.partition import cut

    for n in gm.graph.nodes:
        n.meta[_ORIG] = n.name
    try:
        mine = cut(gm, _claims(job, workers), default=0)
    except Exception:  # noqa: BLE001 - the plan's own names are then shown
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
