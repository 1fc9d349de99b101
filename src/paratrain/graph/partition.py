"""Cut a traced model into per-worker parts, with exactly the values that cross each cut.

Each node's rank comes from ``claims`` (module path -> rank, :func:`node_owners`):

- ``call_module`` / ``get_attr``: the rank of the longest claimed prefix of its module path;
  unclaimed: :data:`DEFAULT_RANK` (rank 0, DESIGN §4).
- any other op: the rank of the innermost claimed module it was traced in; outside every
  claimed module it follows its data (the rank all its consumers agree on, else that of its
  latest-computed input). In an exported graph an op of an unclaimed module that holds
  parameters or contains no claim runs on rank 0; a field of a leaf's tuple with the leaf.
- a value computed from the batch alone (a causal mask) runs on every rank that reads it,
  each computing its own copy (one that draws random numbers runs once, where first read).
- placeholders belong to no rank: every rank reads the batch.

Nodes are grouped into *parts* (:func:`_parts`): in graph order a node joins its rank's latest
part unless that would close a cycle between parts, and parts are numbered topologically, so
a rank owns several parts exactly when its nodes need another rank's output in between
(``A -> B -> A``). The cut itself is ``torch.fx.passes.split_module``: part ``k`` becomes
``submod_k`` taking exactly the values it reads from other parts. Parameters read by
``get_attr`` (a tied head) are hoisted into the top graph as an :class:`Attr`, held by the
rank owning its module and sent to the parts that read it (its gradient sent back: a tie
across workers stays one tensor).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from .trace import CAPTURE, IN_SPEC, OUT_SPEC, module_of

DEFAULT_RANK = 0  # the rank of what no claim covers


def owner_of_path(path: str, claims: Mapping[str, int]) -> int | None:
    """The rank of the longest claimed prefix of module ``path`` (None: unclaimed)."""
    probe = path
    while True:
        if probe in claims:
            return claims[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def attr_module(target: str) -> str:
    return target.rpartition(".")[0]


def _follow_fields_and_consumers(nodes: list[fx.Node], owner: dict[str, int]) -> None:
    """A field taken out of a leaf's tuple / ModelOutput (``out[0]``,
    ``out.last_hidden_state``) runs where the leaf ran: what crosses is then the tensor, not
    the structure. Then a node all of whose consumers agree runs with them (reverse order)."""
    for n in nodes:
        if (n.name not in owner and n.op == "call_function"
                and n.target in (operator.getitem, getattr)
                and isinstance(n.args[0], fx.Node) and n.args[0].name in owner):
            owner[n.name] = owner[n.args[0].name]
    for n in reversed(nodes):
        if n.name in owner:
            continue
        users = [u for u in n.users if u.op != "output"]
        got = {owner.get(u.name) for u in users}
        if users and len(got) == 1 and None not in got and len(users) == len(n.users):
            owner[n.name] = got.pop()  # type: ignore[assignment]


def node_owners(gm: fx.GraphModule, claims: Mapping[str, int]) -> dict[str, int]:
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    owner: dict[str, int] = {}
    # exported (no call_module nodes): an op of an unclaimed module runs on rank 0 as
    # the module would under fx, unless the module contains claims (then it follows its data)
    exported = gm.meta.get(CAPTURE) == "export"
    holders = {name for name, m in gm.named_modules() if name and (m._parameters or m._buffers)}

    def home(n: fx.Node, mod: str) -> bool:
        if not exported or mod.startswith("_") or not isinstance(n.meta.get("val"), torch.Tensor):
            return False
        return mod in holders or not any(c.startswith(mod + ".") for c in claims)

    for n in nodes:
        if n.op == "call_module":
            r = owner_of_path(str(n.target), claims)
            owner[n.name] = DEFAULT_RANK if r is None else r
        elif n.op == "get_attr":
            r = owner_of_path(attr_module(str(n.target)), claims)
            if r is not None or attr_module(str(n.target)):
                owner[n.name] = DEFAULT_RANK if r is None else r
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
                    owner[n.name] = DEFAULT_RANK
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
            owner[n.name] = owner[users[0].name] if users else DEFAULT_RANK
    for n in reversed(nodes):
        if n.name in free:
            users = sorted((u for u in n.users if u.name in owner), key=lambda u: index[u.name])
            owner[n.name] = owner[users[0].name] if users else DEFAULT_RANK
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


@dataclass(frozen=True)
class Part:
    """One ``submod_k``: run on ``rank``; ``inputs``/``outputs`` name top-level values."""

    index: int
    rank: int
    module: fx.GraphModule
    nodes: tuple[str, ...]  # the module ids it calls, in order
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    qualnames: dict[str, str] = field(default_factory=dict)  # module path in ``module`` -> in the model

    def original_name(self, name: str) -> str:
        """A tensor name of ``module`` as the model names it: its longest module path in
        ``qualnames`` renamed (``back_gate.fc.weight`` is ``back.gate`` + ``.fc.weight``)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            head = ".".join(parts[:i])
            if head in self.qualnames:
                return ".".join([self.qualnames[head], *parts[i:]])
        return name


@dataclass(frozen=True)
class Attr:
    """A parameter, buffer or constant read by ``get_attr``: held by ``rank``."""

    name: str  # the top-level value name
    target: str  # its qualified name in the model (in the captured graph for a constant)
    rank: int
    # a constant torch.export lifted (``lifted_tensor_0``: a tensor the forward makes from
    # literals), which the graph holds and the user's model does not: its value
    constant: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)

    def value(self, model: nn.Module) -> torch.Tensor:
        """The tensor this ``get_attr`` reads: the model's parameter or buffer, or the constant."""
        if self.constant is not None:
            return self.constant
        mod, _, name = self.target.rpartition(".")
        t: torch.Tensor = getattr(model.get_submodule(mod), name)
        return t


@dataclass(frozen=True)
class Transfer:
    """Value ``value`` travels ``src -> dst`` each micro-batch (its gradient back)."""

    index: int
    value: str
    src: int
    dst: int


@dataclass
class Cut:
    """The model cut into parts, and every value that crosses between ranks."""

    parts: tuple[Part, ...]
    attrs: tuple[Attr, ...]
    inputs: tuple[str, ...]  # the model's placeholders (from the batch, on every rank)
    output: Any  # the model's output structure, with value names for fx nodes
    output_values: tuple[str, ...]
    loss_rank: int
    producer: dict[str, tuple[str, int]]  # value -> ("input"|"attr"|"part", part index or -1)
    rank_of_value: dict[str, int | None]
    transfers: tuple[Transfer, ...]
    owner: dict[str, int] = field(default_factory=dict)  # fx node name -> rank
    call_order: tuple[str, ...] = ()  # module ids in execution order
    capture: str = "fx"  # "fx" (symbolic_trace) or "export" (torch.export, trace.export_graph)
    # export: the pytree specs of the model's (args, kwargs) and output (None: fx, whose
    # placeholders are forward's parameters and whose output structure is ``output``)
    in_spec: Any = None
    out_spec: Any = None
    input_defaults: dict[str, Any] = field(default_factory=dict)  # fx: a parameter's default

    def parts_of(self, rank: int) -> list[Part]:
        return [p for p in self.parts if p.rank == rank]

    def ranks(self) -> list[int]:
        return list(dict.fromkeys(p.rank for p in self.parts))


def _parts(gm: fx.GraphModule, owner: Mapping[str, int]) -> dict[str, int]:
    """Group nodes into parts (module docstring): fx node name -> part id, ids in a
    topological order; ``get_attr`` reads are hoisted out of the parts and join none."""
    part_of: dict[str, int] = {}
    rank_of: list[int] = []
    deps: list[set[int]] = []  # direct dependencies of each part
    latest: dict[int, int] = {}

    def depends(a: int, b: int) -> bool:  # does part a (transitively) depend on part b?
        stack, seen = [a], set()
        while stack:
            q = stack.pop()
            if q == b:
                return True
            if q not in seen:
                seen.add(q)
                stack.extend(deps[q])
        return False

    for n in gm.graph.nodes:
        if n.name not in owner or n.op == "get_attr":
            continue
        r = owner[n.name]
        ins = {part_of[a.name] for a in n.all_input_nodes if a.name in part_of}
        cur = latest.get(r)
        if cur is None or any(q != cur and depends(q, cur) for q in ins):
            cur = len(rank_of)
            rank_of.append(r)
            deps.append(set())
            latest[r] = cur
        part_of[n.name] = cur
        deps[cur] |= {q for q in ins if q != cur}
    # Topological order of the parts (Kahn's algorithm, ties by creation order).
    order: list[int] = []
    done: set[int] = set()
    while len(order) < len(rank_of):
        q = next(q for q in range(len(rank_of)) if q not in done and deps[q] <= done)
        order.append(q)
        done.add(q)
    new_id = {q: i for i, q in enumerate(order)}
    return {name: new_id[q] for name, q in part_of.items()}


def _constant(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    """The tensor at ``target`` when ``gm`` holds it as neither a parameter nor a buffer (a
    constant ``torch.export`` lifted, e.g. ``lifted_tensor_0``), else None."""
    mod, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(mod)
    except AttributeError:
        return None
    if name in owner._parameters or name in owner._buffers:
        return None
    t = getattr(owner, name, None)
    return t if isinstance(t, torch.Tensor) else None


def cut(gm: fx.GraphModule, claims: Mapping[str, int]) -> Cut:
    """Split ``gm`` by ``claims`` (module path -> rank); see the module docstring."""
    owner = node_owners(gm, claims)
    part_of = _parts(gm, owner)
    exported = gm.meta.get(CAPTURE) == "export"
    calls = _module_calls(gm, part_of, exported)
    rank_of_part = {part_of[name]: owner[name] for name in part_of}

    qualname_map: dict[str, str] = {}
    # get_attr nodes are hoisted into the top graph (any part id will do). keep_original_order
    # =False: split_module orders the parts by their dependencies (with True it emits them by
    # first node, which fails when a part begins before another it reads from, e.g. a tower's
    # add that the join's worker runs).
    split = split_module(gm, gm, lambda node: part_of.get(node.name, 0), qualname_map=qualname_map,
                         keep_original_order=False)
    top = split.graph
    producer: dict[str, tuple[str, int]] = {}
    rank_of_value: dict[str, int | None] = {}
    parts: list[Part] = []
    attrs: list[Attr] = []
    inputs: list[str] = []
    output: Any = None
    for n in top.nodes:
        if n.op == "placeholder":
            inputs.append(n.name)
            producer[n.name], rank_of_value[n.name] = ("input", -1), None
        elif n.op == "get_attr":
            target = str(n.target)
            r = owner.get(n.name, owner_of_path(attr_module(target), claims))
            attrs.append(Attr(n.name, target, DEFAULT_RANK if r is None else r, _constant(gm, target)))
            producer[n.name], rank_of_value[n.name] = ("attr", -1), attrs[-1].rank
        elif n.op == "call_module":
            k = int(str(n.target).rpartition("_")[2])
            getitems = {int(u.args[1]): u.name for u in n.users
                        if u.op == "call_function" and u.target is operator.getitem}
            outs = (tuple(getitems[i] for i in sorted(getitems)) if getitems else (n.name,))
            sub = getattr(split, str(n.target))
            prefix = f"{n.target}."
            names = {q[len(prefix):]: orig for q, orig in qualname_map.items() if q.startswith(prefix)}
            parts.append(Part(k, rank_of_part[k], sub, tuple(calls.get(k, [])),
                              tuple(a.name for a in n.args), outs, names))
            for v in outs:
                producer[v], rank_of_value[v] = ("part", k), rank_of_part[k]
        elif n.op == "output":
            output = fx.node.map_arg(n.args[0], lambda a: _ValueName(a.name))
    out_values: list[str] = []
    fx.node.map_aggregate(output, lambda a: out_values.append(a) if isinstance(a, _ValueName) else a)
    producing = [producer[v][1] for v in out_values if producer[v][0] == "part"]
    if producing:
        loss_rank = rank_of_part[max(producing)]
    else:
        loss_rank = next((rank_of_value[v] for v in out_values if rank_of_value[v] is not None), DEFAULT_RANK) or 0
    transfers = _transfers(parts, out_values, rank_of_value, loss_rank)
    parts.sort(key=lambda p: p.index)  # our numbering: a topological order of the parts
    return Cut(tuple(parts), tuple(attrs), tuple(inputs), output,
               tuple(str(v) for v in out_values), loss_rank, producer, rank_of_value,
               tuple(transfers), owner,
               tuple(m for k in sorted(calls) for m in calls[k]) if exported else
               tuple(str(n.target) for n in gm.graph.nodes if n.op == "call_module"),
               capture="export" if exported else "fx", in_spec=gm.meta.get(IN_SPEC),
               out_spec=gm.meta.get(OUT_SPEC),
               input_defaults={n.name: n.args[0] for n in gm.graph.nodes
                               if n.op == "placeholder" and n.args})


def _module_calls(gm: fx.GraphModule, part_of: Mapping[str, int], exported: bool) -> dict[int, list[str]]:
    """Part -> the modules it calls, in order."""
    calls: dict[int, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and not exported:
            calls.setdefault(part_of[n.name], []).append(str(n.target))
        elif exported and n.name in part_of:
            # an exported graph's nodes are operations: a part lists the modules whose
            # forwards they ran in (innermost; a dropout module export_graph put there: its
            # module), in order
            mod = module_of(n)
            if mod and mod.rpartition(".")[2].startswith("_mode_op"):
                mod = mod.rpartition(".")[0]
            got = calls.setdefault(part_of[n.name], [])
            if mod and mod not in got and not mod.startswith("_"):
                got.append(mod)
    return calls


def _transfers(parts: list[Part], out_values: list[str], rank_of_value: Mapping[str, int | None],
               loss_rank: int) -> list[Transfer]:
    """Each value a part (or the loss) reads from another rank, once per destination, in
    the order the parts read them."""
    transfers: list[Transfer] = []
    seen: set[tuple[str, int]] = set()

    def need(value: str, dst: int) -> None:
        src = rank_of_value[value]
        if src is None or src == dst or (value, dst) in seen:
            return
        seen.add((value, dst))
        transfers.append(Transfer(len(transfers), value, src, dst))

    for p in parts:
        for v in p.inputs:
            need(v, p.rank)
    for v in out_values:
        need(v, loss_rank)
    return transfers


class _ValueName(str):
    """A value name inside the output structure (tells it apart from a constant str)."""
