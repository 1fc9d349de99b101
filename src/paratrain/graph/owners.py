"""Which rank runs each node of a traced graph, from ``claims`` (module path -> rank).

- ``call_module`` / ``get_attr``: the rank of the longest claimed prefix of its module path;
  unclaimed: ``default`` (rank 0, DESIGN §4).
- any other op: the rank of the innermost claimed module it was traced in; outside every
  claimed module it follows its data (the rank all its consumers agree on, else that of its
  latest-computed input). In an exported graph an op of an unclaimed module that holds
  parameters or contains no claim runs on ``default``; a field of a leaf's tuple with the leaf.
- a value computed from the batch alone (a causal mask) runs on every rank that reads it,
  each computing its own copy (one that draws random numbers runs once, where first read).
- placeholders belong to no rank: every rank reads the batch.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from .export import CAPTURE
from .trace import module_of


def owner_of_path(path: str, claims: Mapping[str, int]) -> int | None:
    """The rank of the longest claimed prefix of module ``path`` (None: unclaimed)."""
    probe = path
    while True:
        if probe in claims:
            return claims[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


_FIELD_OPS = (operator.getitem, getattr)


def attr_module(target: str) -> str:
    return target.rpartition(".")[0]


def _follow_fields_and_consumers(nodes: list[fx.Node], owner: dict[str, int]) -> None:
    """A field taken out of a leaf's tuple / ModelOutput (``out[0]``,
    ``out.last_hidden_state``) runs where the leaf ran: what crosses is then the tensor, not
    the structure. Then a node all of whose consumers agree runs with them (reverse order)."""
    for n in nodes:
        if (n.name not in owner and n.op == "call_function" and n.target in _FIELD_OPS
                and isinstance(n.args[0], fx.Node) and n.args[0].name in owner):
            owner[n.name] = owner[n.args[0].name]
    for n in reversed(nodes):
        if n.name in owner:
            continue
        users = [u for u in n.users if u.op != "output"]
        got = {owner.get(u.name) for u in users}
        if users and len(got) == 1 and None not in got and len(users) == len(n.users):
            owner[n.name] = got.pop()  # type: ignore[assignment]


def node_owners(gm: fx.GraphModule, claims: Mapping[str, int], default: int) -> dict[str, int]:
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    owner: dict[str, int] = {}
    # exported (no call_module nodes): an op of an unclaimed module runs on ``default`` as
    # the module would under fx, unless the module contains claims (then it follows its data)
    exported = gm.meta.get(CAPTURE) == "export"
    holders = _holders(gm) if exported else set()

    def home(n: fx.Node, mod: str) -> bool:
        if not exported or mod.startswith("_") or not isinstance(n.meta.get("val"), torch.Tensor):
            return False
        return mod in holders or not any(c.startswith(mod + ".") for c in claims)

    for n in nodes:
        if n.op == "call_module":
            r = owner_of_path(str(n.target), claims)
            owner[n.name] = default if r is None else r
        elif n.op == "get_attr":
            r = owner_of_path(attr_module(str(n.target)), claims)
            if r is not None or attr_module(str(n.target)):
                owner[n.name] = default if r is None else r
        else:
            stack = n.meta.get("nn_module_stack") or {}
            for v in reversed(list(stack.values())):
                path = v[0] if isinstance(v, tuple) else str(v)
                if path in claims:
                    owner[n.name] = claims[path]
                    break
            else:
                # a claim on an ancestor of the op's module (e.g. the op runs inside
                # block0.attn's forward and block0 is claimed)
                mod = module_of(n)
                r = None if mod is None else owner_of_path(mod, claims)
                if r is not None:
                    owner[n.name] = r
                elif mod and home(n, mod):
                    owner[n.name] = default
    _follow_fields_and_consumers(nodes, owner)
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    # a value computed from the batch alone runs where it is read (module docstring)
    free: set[str] = set()
    for n in nodes:
        if n.name not in owner and n.op == "call_function" and all(
                a.op == "placeholder" or a.name in free for a in n.all_input_nodes):
            free.add(n.name)
    for n in nodes:
        if n.name in owner or n.name in free:
            continue
        ins = [a for a in n.all_input_nodes if a.name in owner]
        if ins:
            owner[n.name] = owner[max(ins, key=lambda a: index[a.name]).name]
        else:
            users = [u for u in n.users if u.name in owner]
            owner[n.name] = owner[users[0].name] if users else default
    for n in reversed(nodes):
        if n.name in free:
            users = sorted((u for u in n.users if u.name in owner), key=lambda u: index[u.name])
            owner[n.name] = owner[users[0].name] if users else default
            if _pure(n):
                for dup in _copy_per_rank(gm.graph, n, users, owner):
                    index[dup] = index[n.name]
    return owner


def _pure(n: fx.Node) -> bool:
    """An ATen operation that draws no random numbers, or Python's operator arithmetic."""
    if isinstance(n.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded not in n.target.tags
    return getattr(n.target, "__module__", None) in ("_operator", "operator")


def _copy_per_rank(graph: fx.Graph, n: fx.Node, users: list[fx.Node], owner: dict[str, int]) -> list[str]:
    """Give each rank other than ``n``'s that reads ``n`` its own copy of it (their names)."""
    made: list[str] = []
    for r in sorted({owner[u.name] for u in users} - {owner[n.name]}):
        with graph.inserting_after(n):
            dup = graph.node_copy(n)
        dup.meta = dict(n.meta)
        owner[dup.name] = r
        made.append(dup.name)
        for u in users:
            if owner[u.name] == r:
                u.replace_input_with(n, dup)
    return made


def _holders(gm: fx.GraphModule) -> set[str]:
    return {name for name, m in gm.named_modules()
            if name and (m._parameters or m._buffers)}
