"""The per-rank ModelParallel runtime: run this rank's parts of the cut graph over a transport.

The model is cut into parts ``P_0 .. P_{k-1}`` in topological order
(:mod:`paratrain.graph.partition`); ``P_p`` takes the values ``inputs(p)`` (the model's
arguments, other parts' outputs, parameters read by ``get_attr``) and returns ``outputs(p)``.
For micro-batch ``i`` of a ``B``-row batch:

- ``F(i, p)``: gather ``inputs(p)`` (the model's arguments on the micro-batch's rows: every
  rank reads the batch; a value received from another rank, key ``("act", i, t)``; or one of
  my parts' outputs, detached so each part's backward stays its own), run ``P_p``, send each
  output to every rank that reads it. The loss part forms ``L_i = w * loss(out_i, batch_i) *
  n_i / B`` (``loss`` the task's mean over the ``n_i`` rows, ``w`` the batch's weight).
- ``B(i, p)``: backpropagate ``L_i`` and, for each output, the sum of ``dL/dv`` over all its
  readers (received ``("grad", i, t)``, or from my later parts) through ``P_p``; send
  ``dL/d(input)`` back once my last reader of that input has run.
- ``W(i, p)`` (ZBH1): the weight gradients ``B`` left (:mod:`.backward_split`).
- a parameter read on another rank than its holder's (a tie across workers) is sent once per
  step; its gradient, summed over the micro-batches, comes back after the last.

Since ``sum_i L_i = w * loss(batch)`` for a loss that is a mean over rows, and gradients add
over readers and micro-batches, the loss and every gradient equal the unpartitioned model's
(up to float summation order). Orders come from :mod:`.schedule`. A batch is any pytree of
tensors (micro-batch ``i``: rows ``[a_i, b_i)`` of every leaf with a leading dimension), a
*feed* (the task's ``model_args``) how it calls the model.

Why not ``torch.distributed.pipelining``: its stages are a linear chain, while a cut here is
any topology (a value may skip stages or go back to a rank's earlier part, towers may join, a
stage may be replicated or tensor-parallel, a tie across workers stays one tensor). Where both
run the same thing they agree (``tests/executors/model_parallel/test_pipeline_vs_torch.py``).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...graph.partition import Cut, Part
from ...training.stepping import autocast
from .backward_split import Deferred, backward_inputs
from .plan import Plan, Replicas, pieces, row_bounds
from .schedule import SPLIT_BACKWARD, VIRTUAL, Action, micro_batch_sizes, schedule, sequential

#: How many actions ahead a stage posts its receives (transports with ``post``).
RECV_LOOKAHEAD = 2
#: ``loss_fn(output, batch) -> scalar``: the mean loss of a (micro-)batch (a Task's ``loss``).
LossFn = Callable[[Any, Sequence[torch.Tensor]], torch.Tensor]


def slot_of(t: int, j: int = 0, k: int = 0) -> int:
    """Message slot of transfer ``t`` between sender replica ``j`` and receiver replica ``k``."""
    return t * 64 + j * 8 + k


#: ``batch -> (args, kwargs)``: how a batch calls the model.
Feed = Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]


def first_field(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The default feed: ``model(batch[0])`` (a bare tensor: ``model(batch)``)."""
    return ((batch[0],) if isinstance(batch, tuple | list) else (batch,)), {}


def batch_rows(tree: Any) -> int:
    """The leading size of the first tensor leaf with one (1 when there is none)."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def rows_of(tree: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of every tensor leaf with a leading dimension."""
    return pytree.tree_map(
        lambda t: t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, tree)


def model_inputs(cut: Cut, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Each graph input's value for a model call ``(args, kwargs)``: the forward's parameters
    under torch.fx, the leaves of ``(args, kwargs)`` under torch.export (``Cut.in_spec``)."""
    if cut.capture == "export":
        order = _kwarg_order(cut.in_spec)
        if order is not None and set(order) == set(kwargs):
            kwargs = {k: kwargs[k] for k in order}
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        if len(leaves) != len(cut.inputs):
            raise ValueError(
                f"the model was captured with {len(cut.inputs)} input tensors "
                f"({', '.join(cut.inputs)}) but this batch calls it with {len(leaves)}: batches "
                f"must have the structure of the one it was captured on")
        return dict(zip(cut.inputs, leaves, strict=True))
    return {name: args[i] if i < len(args) else kwargs.get(name, cut.input_defaults.get(name))
            for i, name in enumerate(cut.inputs)}


def _kwarg_order(spec: Any) -> list[str] | None:
    children = spec.children() if callable(getattr(spec, "children", None)) else None
    if not children or len(children) != 2:
        return None
    context = getattr(children[1], "context", None)
    return list(context) if isinstance(context, list | tuple) else None


def model_output(cut: Cut, env: dict[str, Any]) -> Any:
    """The model's output from the values in ``env`` (rebuilt as the model returns it)."""
    out = fx.node.map_aggregate(cut.output, lambda a: env[a] if isinstance(a, str) and a in env else a)
    if cut.out_spec is not None:
        return pytree.tree_unflatten(list(out) if isinstance(out, tuple | list) else [out],
                                     cut.out_spec)
    return out


def segment_modules(model: nn.Module, plan: Plan, rank: int) -> dict[int, nn.Module]:
    """This rank's parts as modules (fx GraphModules sharing the model's parameters)."""
    del model  # the parts were cut from it and hold its modules
    return {p.index: p.module for p in plan.segments_of(rank)}


def held_attrs(model: nn.Module, plan: Plan, rank: int) -> dict[str, torch.Tensor]:
    """Parameters/buffers read by ``get_attr`` that ``rank`` holds: value name -> tensor."""
    return {a.name: a.value(model) for a in plan.cut.attrs if a.rank == rank}


@dataclass
class StepStats:
    """What one call ran: its wall time, compute time and activation peak."""

    step_s: float = 0.0
    compute_s: float = 0.0
    peak_activation_bytes: int = 0
    trace: list[tuple[str, int, int, float, float]] = field(default_factory=list)

    @property
    def order(self) -> list[Action]:
        return [(k, i, s) for k, i, s, _, _ in self.trace]  # type: ignore[misc]


class SavedBytes:
    """Counts distinct non-parameter storages saved for backward (a pack hook)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in self.exclude:
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def cross_entropy(out: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def as_tuple(out: Any, n: int) -> tuple[Any, ...]:
    return tuple(out) if n > 1 else (out,)


def detached_leaf(t: Any) -> Any:
    """A detached copy that records its own gradient (floating tensors only)."""
    if isinstance(t, torch.Tensor):
        d = t.detach()
        if d.is_floating_point():
            d.requires_grad_(True)
        return d
    return t


class StageRuntime:
    """Runs this rank's parts of the model for a train step or a forward pass."""

    def __init__(self, plan: Plan, rank: int, modules: dict[int, nn.Module],
                 transport: Any, *, device: torch.device | None = None,
                 attrs: dict[str, torch.Tensor] | None = None,
                 replicas: Replicas | None = None, physical_rank: int | None = None,
                 feed: Feed | None = None) -> None:
        self.plan, self.cut = plan, plan.cut
        self.feed = feed or first_field
        self.device = device or torch.device("cpu")
        self.rank = rank  # the stage's rank in the plan (a replica's primary)
        self.replicas = replicas or Replicas()
        self.replica = self.replicas.of(rank).index(rank if physical_rank is None else physical_rank)
        self.num_replicas = self.replicas.count(rank)
        self.modules = modules
        self.transport = transport
        self.attrs = dict(attrs or {})
        self.stats = StepStats()
        c = self.cut
        self.parts: dict[int, Part] = {p.index: p for p in c.parts_of(rank)}
        producing = [c.producer[v][1] for v in c.output_values if c.producer[v][0] == "part"]
        self.loss_part = max(producing) if producing else None
        # the values each of my parts reads (the loss part also reads the model's output)
        self.reads: dict[int, list[str]] = {}
        for idx, p in self.parts.items():
            extra = [v for v in c.output_values if v not in p.outputs and v not in p.inputs] \
                if idx == self.loss_part else []
            self.reads[idx] = list(p.inputs) + extra
        self.readers_here = Counter(v for vals in self.reads.values() for v in set(vals))
        self.out_transfers = [t for t in c.transfers if t.src == rank]
        self.in_transfers = {t.value: t for t in c.transfers if t.dst == rank}
        held = [*(p for m in modules.values() for p in m.parameters()), *self.attrs.values()]
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in held}
        self._sizes: list[int] = []

    def actions(self, num_micro: int, schedule_name: str | None) -> list[Action]:
        """This rank's order: a pipeline schedule (one part per rank) or sequential."""
        mine = sorted(self.parts)
        if not mine:
            return []
        if schedule_name is None:
            return sequential(mine, num_micro)
        if schedule_name in VIRTUAL:  # parts r, r + p, ..: chunks placed round-robin
            p = len(self.plan.cut.ranks())
            v = self.plan.num_segments // p
            if mine != list(range(mine[0], mine[0] + v * p, p)):
                raise ValueError(f"rank {self.rank} owns parts {mine}; {schedule_name} needs "
                                 f"{v} parts {p} apart")
            return schedule(schedule_name, mine[0], p, num_micro, v)
        if len(mine) != 1:
            raise ValueError(f"rank {self.rank} owns parts {mine}; a pipeline needs one")
        return schedule(schedule_name, mine[0], self.plan.num_segments, num_micro)

    def _is_attr(self, v: str) -> bool:
        return self.cut.producer[v][0] == "attr"

    def train_step(self, x: torch.Tensor, y: torch.Tensor, *, step: int,
                   micro_batch_size: int | None = None,
                   schedule_name: str | None = None) -> float | None:
        """One forward/backward of the classification loss (cross-entropy) over ``(x, y)``."""
        return self.run_batch((x, y), step=step, micro_batch_size=micro_batch_size,
                              schedule_name=schedule_name, loss_fn=cross_entropy)

    def run_batch(self, batch: Any, *, step: int,
                  micro_batch_size: int | None = None, schedule_name: str | None = None,
                  loss_fn: LossFn | None = None, weight: float = 1.0,
                  precision: str = "fp32") -> float | None:
        """One forward/backward over ``batch`` (any pytree of row-major tensors, the model
        called with ``self.feed(micro_batch)``; module docstring); the batch's unweighted
        loss on the loss part's rank (None elsewhere). ``schedule_name=None``: sequential."""
        rows = batch_rows(batch)
        sizes = micro_batch_sizes(rows, micro_batch_size or rows)
        bounds = [0, *itertools.accumulate(sizes)]
        # this replica's rows of each micro-batch (all of them when the stage is not replicated)
        own = [row_bounds(n, self.num_replicas)[self.replica] for n in sizes]
        micro = [rows_of(batch, bounds[i] + own[i][0], bounds[i] + own[i][1])
                 for i in range(len(sizes))]
        self._sizes = sizes
        order = [a for a in self.actions(len(sizes), schedule_name) if own[a[1]][1] > own[a[1]][0]]
        in_batch = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(batch)
                    if isinstance(t, torch.Tensor)}  # the batch's storages are no activations
        run = _StepRun(self, step=step, micro=micro, own=own, rows=rows, precision=precision,
                       loss_fn=loss_fn or cross_entropy, weight=weight, in_batch=in_batch,
                       split=schedule_name in SPLIT_BACKWARD)
        t_start = time.perf_counter()
        run.remote_attrs = self._exchange_attrs(step)
        needs = [self._recv_specs(kind, i, s) for kind, i, s in order]
        post = getattr(self.transport, "post", None)
        for j, (kind, i, s) in enumerate(order):
            if post is not None:
                # Post the next receives now so their payloads arrive while we compute.
                for ahead in needs[j + 1: j + 1 + RECV_LOOKAHEAD]:
                    for src, key, n in ahead:
                        post(src=src, key=key, step=step, rows=n)
            {"F": run.forward, "W": run.weights, "B": run.backward}[kind](i, s)
        self._return_attr_grads(run.remote_attrs, step)
        self.transport.flush()
        run.stats.step_s = time.perf_counter() - t_start
        self.stats = run.stats
        return run.loss_total

    def _exchange_attrs(self, step: int) -> dict[str, torch.Tensor]:
        """Parameters other ranks read: sent once per step; the ones I read, received (a
        replicated holder's primary sends; every replica of a reader receives)."""
        tr = self.transport
        for t in self.out_transfers:
            if self._is_attr(t.value) and self.replica == 0:
                for k, dst in enumerate(self.replicas.of(t.dst)):
                    tr.send(self.attrs[t.value].detach(), dst=dst, key=("act", 0, slot_of(t.index, 0, k)), step=step)
        return {v: detached_leaf(tr.recv(src=self.replicas.of(t.src)[0],
                                         key=("act", 0, slot_of(t.index, 0, self.replica)),
                                         step=step).to(self.device))
                for v, t in self.in_transfers.items() if self._is_attr(v)}

    def _return_attr_grads(self, remote_attrs: dict[str, torch.Tensor], step: int) -> None:
        """Gradients of the parameters I read from other ranks go back to their holders;
        mine come back from every reader and add up."""
        tr = self.transport
        for v, leaf in remote_attrs.items():
            t = self.in_transfers[v]
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            tr.send(g, dst=self.replicas.of(t.src)[0], key=("grad", 0, slot_of(t.index, 0, self.replica)), step=step)
        for t in self.out_transfers:
            if self._is_attr(t.value) and self.replica == 0:
                for k, src in enumerate(self.replicas.of(t.dst)):
                    g = tr.recv(src=src, key=("grad", 0, slot_of(t.index, 0, k)), step=step).to(self.device)
                    param = self.attrs[t.value]
                    if param.requires_grad:
                        param.grad = g.to(param.dtype) if param.grad is None else param.grad + g

    def send_metric(self, values: torch.Tensor, *, dst: int, step: int, slot: int = 0) -> None:
        """Send a small metrics tensor (e.g. the loss) to ``dst``; ``slot`` separates kinds."""
        self.transport.send(values, dst=dst, key=("metric", slot, 0), step=step)
        self.transport.flush()

    def recv_metric(self, *, src: int, step: int, slot: int = 0) -> torch.Tensor:
        return self.transport.recv(src=src, key=("metric", slot, 0), step=step)

    def _links(self, i: int, t: Any, *, mine_is_src: bool) -> list[tuple[int, int, int, int]]:
        """``(peer physical rank, slot, start, stop)`` of each piece of transfer ``t`` for
        micro-batch ``i`` that this replica sends (``mine_is_src``) or receives, rows
        relative to this replica's own rows."""
        n = self._sizes[i]
        rs, rd = self.replicas.count(t.src), self.replicas.count(t.dst)
        me = self.replica
        base = row_bounds(n, self.num_replicas)[me][0]
        out = []
        for j, k, lo, hi in pieces(n, rs, rd):
            if mine_is_src and j == me:
                out.append((self.replicas.of(t.dst)[k], slot_of(t.index, j, k), lo - base, hi - base))
            elif not mine_is_src and k == me:
                out.append((self.replicas.of(t.src)[j], slot_of(t.index, j, k), lo - base, hi - base))
        return out

    def _send_rows(self, val: torch.Tensor, kind: str, i: int, t: Any, step: int, *, to_src: bool) -> None:
        """Send ``val`` (this replica's rows of a value of transfer ``t``) cut into the rows
        each peer replica holds: activations to ``t.dst``'s replicas, gradients back to
        ``t.src``'s. Cutting by rows needs one row per example: a value of another leading
        size (an exported model's rotary table, shape ``(1, T, d)``) crossing into or out of
        a replicated stage is a ValueError naming it."""
        if self.replicas.count(t.src) > 1 or self.replicas.count(t.dst) > 1:
            lo, hi = row_bounds(self._sizes[i], self.num_replicas)[self.replica]
            if val.dim() == 0 or val.shape[0] != hi - lo:
                raise ValueError(
                    f"model-parallel value {t.value!r} of shape {tuple(val.shape)} crosses into or "
                    f"out of a replicated stage but is not one row per example ({hi - lo} rows "
                    f"here): a replicated stage cuts what it reads and sends by rows; do not "
                    f"replicate that stage, or place the nodes that make and read it together")
        for peer, slot, lo, hi in self._links(i, t, mine_is_src=not to_src):
            self.transport.send(val[lo:hi], dst=peer, key=(kind, i, slot), step=step, rows=hi - lo)

    def _recv_rows(self, kind: str, i: int, t: Any, step: int, *, from_src: bool) -> torch.Tensor:
        parts = [self.transport.recv(src=peer, key=(kind, i, slot), step=step, rows=hi - lo)
                 for peer, slot, lo, hi in self._links(i, t, mine_is_src=not from_src)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device)

    def _recv_specs(self, kind: str, i: int, s: int) -> list[tuple[int, tuple[str, int, int], int]]:
        """``(src, key, rows)`` of the messages action ``(kind, i, s)`` waits for."""
        out: list[tuple[int, tuple[str, int, int], int]] = []
        if kind == "F":
            for v in self.reads[s]:
                t = self.in_transfers.get(v)
                if t is not None and not self._is_attr(v):
                    out += [(peer, ("act", i, slot), hi - lo)
                            for peer, slot, lo, hi in self._links(i, t, mine_is_src=False)]
        elif kind == "B":  # a W waits for nothing
            for v in self.parts[s].outputs:
                for t in self.out_transfers:
                    if t.value == v:
                        out += [(peer, ("grad", i, slot), hi - lo)
                                for peer, slot, lo, hi in self._links(i, t, mine_is_src=True)]
        return out

    @torch.no_grad()
    def forward(self, *args: Any, step: int, precision: str = "fp32", **kwargs: Any) -> Any:
        """Evaluation: the placed model called as ``model(*args, **kwargs)`` on a whole batch,
        each stage's primary replica running its parts in order (``("eval", 0, slot)`` keys);
        the output on the loss part's rank (None elsewhere)."""
        c, tr = self.cut, self.transport
        if self.replica > 0:
            return None  # evaluation runs on each stage's primary replica
        prim = self.replicas.of
        rows = batch_rows((args, kwargs))
        env: dict[str, Any] = model_inputs(c, args, kwargs)
        env.update(self.attrs)
        for t in self.out_transfers:
            if self._is_attr(t.value):
                tr.send(self.attrs[t.value], dst=prim(t.dst)[0], key=("eval", 0, slot_of(t.index)), step=step)
        result: Any = None
        for s in sorted(self.parts):
            part = self.parts[s]
            for v in self.reads[s]:
                if v not in env:
                    t = self.in_transfers[v]
                    n = None if self._is_attr(v) else rows
                    env[v] = tr.recv(src=prim(t.src)[0], key=("eval", 0, slot_of(t.index)), step=step,
                                     rows=n).to(self.device)
            with autocast(precision, self.device):
                outs = as_tuple(self.modules[s](*[env[v] for v in part.inputs]), len(part.outputs))
            env.update(zip(part.outputs, outs, strict=True))
            for v, val in zip(part.outputs, outs, strict=True):
                for t in self.out_transfers:
                    if t.value == v:
                        tr.send(val, dst=prim(t.dst)[0], key=("eval", 0, slot_of(t.index)), step=step, rows=rows)
            if s == self.loss_part:
                result = model_output(c, env)
        tr.flush()
        return result


class _StepRun:
    """One :meth:`StageRuntime.run_batch`'s state (what my parts read and produced per
    micro-batch, the activation bytes held) and its F / B / W actions (``split``: ZBH1)."""

    def __init__(self, rt: Any, *, step: int, micro: list[Any], own: list[tuple[int, int]],
                 rows: int, precision: str, loss_fn: LossFn, weight: float, in_batch: set[int],
                 split: bool) -> None:
        self.rt, self.step, self.micro, self.own, self.rows = rt, step, micro, own, rows
        self.precision, self.loss_fn, self.weight, self.in_batch = precision, loss_fn, weight, in_batch
        self.split = split
        self.remote_attrs: dict[str, torch.Tensor] = {}
        self.inputs: dict[int, dict[str, Any]] = {}  # micro -> graph input -> value
        self.got: dict[tuple[int, str], Any] = {}  # (micro, value) -> what my parts read
        self.outs: dict[tuple[int, int], tuple[Any, ...]] = {}  # (micro, part) -> its outputs
        self.loss_terms: dict[int, torch.Tensor] = {}
        self.left: dict[tuple[int, str], int] = {}  # readers here still to run B
        self.held: dict[tuple[int, int], int] = {}
        self.leaves: dict[tuple[int, int], list[torch.Tensor]] = {}  # (micro, part) -> its inputs
        self.deferred: dict[tuple[int, int], Deferred] = {}
        self.live = 0
        self.loss_total: float | None = None
        self.stats = StepStats()

    def _timed(self, kind: str, i: int, s: int, t0: float) -> None:
        t1 = time.perf_counter()
        self.stats.compute_s += t1 - t0
        self.stats.trace.append((kind, i, s, t0, t1))

    def fetch(self, i: int, v: str) -> Any:
        """The value ``v`` for micro-batch ``i`` as my part reads it (F in the module docstring)."""
        rt = self.rt
        kind, producer = rt.cut.producer[v]
        if kind == "input":  # every rank reads the batch: the model's arguments on it
            if i not in self.inputs:
                self.inputs[i] = model_inputs(rt.cut, *rt.feed(self.micro[i]))
            return self.inputs[i][v]
        if kind == "attr":
            return rt.attrs[v] if v in rt.attrs else self.remote_attrs[v]
        if (i, v) not in self.got:
            if producer in rt.parts:
                out = self.outs[(i, producer)][rt.parts[producer].outputs.index(v)]
            else:
                out = rt._recv_rows("act", i, rt.in_transfers[v], self.step, from_src=True)
            self.got[(i, v)] = detached_leaf(out)
            self.left[(i, v)] = rt.readers_here[v]
        return self.got[(i, v)]

    def release(self, i: int, v: str) -> None:
        """After a reader's backward: when it was my last reader of a received value, its
        gradient goes back to the producer (my own part's output: its backward reads it)."""
        if (i, v) not in self.left:
            return
        self.left[(i, v)] -= 1
        if self.left[(i, v)] > 0:
            return
        del self.left[(i, v)]
        if self.rt.cut.producer[v][1] in self.rt.parts:
            return
        leaf = self.got.pop((i, v))
        g = leaf.grad if isinstance(leaf, torch.Tensor) and leaf.grad is not None else torch.zeros_like(leaf)
        self.rt._send_rows(g, "grad", i, self.rt.in_transfers[v], self.step, to_src=True)

    def output_grad(self, i: int, v: str, val: Any) -> torch.Tensor | None:
        """``dL/dv``: my later parts' share plus every other reading rank's."""
        total: torch.Tensor | None = None
        read_here = (i, v) in self.got
        mine = self.got.pop((i, v), None)
        if isinstance(mine, torch.Tensor) and mine.grad is not None:
            total = mine.grad
        sent = [t for t in self.rt.out_transfers if t.value == v]
        for t in sent:
            g = self.rt._recv_rows("grad", i, t, self.step, from_src=False)
            total = g if total is None else total + g
        if total is None and isinstance(val, torch.Tensor) and (read_here or sent):
            total = torch.zeros_like(val)
        return total

    def forward(self, i: int, s: int) -> None:
        rt, part = self.rt, self.rt.parts[s]
        args = [self.fetch(i, v) for v in rt.reads[s]]
        t0 = time.perf_counter()
        meter = SavedBytes(rt._param_ptrs | self.in_batch)
        mine = self.own[i][1] - self.own[i][0]
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), \
                autocast(self.precision, rt.device):
            result = as_tuple(rt.modules[s](*args[: len(part.inputs)]), len(part.outputs))
            if s == rt.loss_part:
                env = dict(zip(rt.reads[s], args, strict=True))
                env.update(zip(part.outputs, result, strict=True))
                mean = self.loss_fn(model_output(rt.cut, env), self.micro[i])
                self.loss_terms[i] = mean * (self.weight * mine / self.rows)
        self._timed("F", i, s, t0)
        if s == rt.loss_part:
            self.loss_total = (self.loss_total or 0.0) + float(mean.detach()) * mine / self.rows
        self.outs[(i, s)] = result
        for v, val in zip(part.outputs, result, strict=True):
            for t in rt.out_transfers:
                if t.value == v:
                    if not isinstance(val, torch.Tensor):
                        raise TypeError(
                            f"model-parallel value {v!r} ({type(val).__name__}) is read on rank {t.dst} "
                            f"but is not a tensor; only tensors travel between workers: place the "
                            f"nodes that make and read it on one worker")
                    rt._send_rows(val.detach(), "act", i, t, self.step, to_src=False)
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is None:
                meter.pack(a)
        for val in result:
            if isinstance(val, torch.Tensor):
                meter.pack(val)
        self.held[(i, s)] = meter.bytes
        if self.split:  # the activations this part received or read from my other parts
            self.leaves[(i, s)] = [a for v, a in zip(rt.reads[s], args, strict=True)
                                   if rt.cut.producer[v][0] == "part" and isinstance(a, torch.Tensor)
                                   and a.requires_grad and a.grad_fn is None]
        self.live += meter.bytes
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self.live)

    def weights(self, i: int, s: int) -> None:
        t0 = time.perf_counter()
        self.deferred.pop((i, s)).run()
        self._timed("W", i, s, t0)
        self.live -= self.held.pop((i, s))

    def backward(self, i: int, s: int) -> None:
        rt, part = self.rt, self.rt.parts[s]
        result = self.outs.pop((i, s))
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if s == rt.loss_part:
            tensors.append(self.loss_terms.pop(i))
            grads.append(None)
        for v, val in zip(part.outputs, result, strict=True):
            g = self.output_grad(i, v, val)
            if g is not None and isinstance(val, torch.Tensor) and val.requires_grad:
                tensors.append(val)
                grads.append(g)
        t0 = time.perf_counter()
        if self.split:
            self.deferred[(i, s)] = backward_inputs(tensors, grads, self.leaves.pop((i, s)))
        elif tensors:
            torch.autograd.backward(tensors, grad_tensors=grads)
        self._timed("B", i, s, t0)
        for v in set(rt.reads[s]):
            self.release(i, v)
        if not self.split:
            self.live -= self.held.pop((i, s))
