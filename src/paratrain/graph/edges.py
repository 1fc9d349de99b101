"""The data flow between a report's nodes (``paratrain graph JOB --out FILE`` draws it): an
edge ``from -> to`` when a value ``from`` computes reaches ``to`` through nodes that are no
listed module. Such a node joining the values of two or more nodes (a residual ``add``) is a
node of its own, named by its fx name (collapsed, each residual block would feed every later
one). Each edge keeps the fx names it passes, so a value crossing workers finds its edge.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .trace import module_of

INPUT, OUTPUT = "(input)", "(output)"


def _owner(n: fx.Node, paths: set[str]) -> str | None:
    """The listed module ``n`` belongs to (None: an intermediate node)."""
    if n.op == "placeholder":
        return INPUT
    if n.op == "output":
        return OUTPUT
    if n.op == "get_attr":  # a tensor of a module: that module's node
        owner = str(n.target).rpartition(".")[0]
        return owner if owner in paths else None
    path = module_of(n)
    return path if path in paths else None


def node_edges(gm: fx.GraphModule, paths: list[str]) -> list[dict[str, Any]]:
    """``[{"from", "to", "through"}]`` between ``paths`` (and the pseudo nodes), in first-seen
    order; ``through``: the fx node names the values pass on the way, the computing node's
    included (see the module docstring)."""
    listed = set(paths)
    # reach[name]: for each listed node whose values flow into fx node `name` unlisted,
    # the fx names they passed (the listed node's own output node first)
    reach: dict[str, dict[str, set[str]]] = {}
    edges: dict[tuple[str, str], set[str]] = {}
    for n in gm.graph.nodes:
        owner = _owner(n, listed)
        incoming: dict[str, set[str]] = {}
        for a in n.all_input_nodes:
            for src, via in reach.get(a.name, {}).items():
                incoming.setdefault(src, set()).update(via)
        # a function of one node's values passes them on, adding itself; the model's inputs
        # do not count (masks and positions made from them would make every op a node)
        if owner is None and len(set(incoming) - {INPUT}) < 2:
            reach[n.name] = {src: via | {n.name} for src, via in incoming.items()}
            continue
        owner = owner or n.name  # a function joining values of several nodes: a node itself
        for src, via in incoming.items():
            if src != owner:
                edges.setdefault((src, owner), set()).update(via)
        reach[n.name] = {owner: {n.name}}
    return [{"from": s, "to": t, "through": sorted(via)} for (s, t), via in edges.items()]
