"""The per-rank ModelParallel stage runtime: run a list of F/B actions over a transport.

A rank holds the modules of its segments (:func:`segment_modules`) and executes an
action order (:mod:`.schedule`). For micro-batch ``i`` of a ``B``-row batch and
segment ``s`` with input ``a_{i,s}`` and output ``a_{i,s+1} = S_s(a_{i,s})``:

- ``F(i, s)``: ``a_{i,s}`` is the micro-batch's rows of ``x`` (``s = 0``) or is received
  from ``owner(S_{s-1})`` (marked ``requires_grad``); compute ``a_{i,s+1}``; send it to
  ``owner(S_{s+1})``, or on the last segment form ``L_i = w * loss(a_{i,k}, batch_i) * n_i / B``
  (``loss`` the task's mean loss of the micro-batch's ``n_i`` rows, ``w`` the weight of this
  batch in its optimizer step: ``n/N`` under gradient accumulation, else 1).
- ``B(i, s)``: backpropagate ``L_i`` (last segment) or the received ``dL/da_{i,s+1}``
  through ``S_s``; send ``dL/da_{i,s}`` back to ``owner(S_{s-1})``.

Because ``sum_i L_i = w * loss(batch)`` for a loss that is a mean over rows and parameter gradients
accumulate over micro-batches, the loss and every parameter gradient equal those of the
unpartitioned model on the same batch (up to float summation order).

Orders come from GPipe (Huang et al. 2019) or 1F1B/PipeDream-Flush (Narayanan et al.
2021) for pipelines, or the sequential order for Direct/DataStore. The transport is
duck-typed (``send(t, dst=, key=, step=, rows=)``, ``recv(src=, key=, step=, rows=)``,
``flush()``, optionally ``post(src=, key=, step=, rows=)`` to post a receive ahead):
:class:`paratrain.comm.p2p.P2PTransport` (Direct, Pipeline) or
:class:`paratrain.comm.datastore.DataStoreTransport` (DataStore). The runtime records
what it ran (``trace``), time computing vs. waiting, and the peak bytes of activations
held for backward (saved tensors plus stage inputs/outputs, parameters excluded).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .plan import Plan
from .schedule import Action, micro_batch_sizes, schedule, sequential

__all__ = ["Transport", "SegmentModule", "segment_modules", "StepStats", "StageRuntime"]


#: How many actions ahead a stage posts its receives (transports with ``post``).
RECV_LOOKAHEAD = 2


class Transport(Protocol):
    def send(self, tensor: torch.Tensor, *, dst: int, key: tuple[str, int, int], step: int = 0,
             rows: int | None = None) -> None: ...
    def recv(self, *, src: int, key: tuple[str, int, int], step: int = 0,
             rows: int | None = None) -> torch.Tensor: ...
    def flush(self) -> None: ...


class SegmentModule(nn.Module):
    """Consecutive nodes applied in order; ``names`` keeps the graph's node ids."""

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.names = list(names)
        self.layers = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def node_state(self) -> dict[str, torch.Tensor]:
        """State keyed ``<node id>/<tensor name>`` (stable across placements)."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in zip(self.names, self.layers, strict=True):
            for k, v in layer.state_dict().items():
                out[f"{name}/{k}"] = v
        return out

    def load_node_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, layer in zip(self.names, self.layers, strict=True):
            prefix = f"{name}/"
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def segment_modules(model: nn.Module, plan: Plan, rank: int) -> dict[int, SegmentModule]:
    """This rank's segments as modules (sharing the model's node modules)."""
    return {
        seg.index: SegmentModule(seg.nodes, [model.get_submodule(n) for n in seg.nodes])
        for seg in plan.segments_of(rank)
    }


@dataclass
class StepStats:
    """What one call ran: its wall time, compute time, blocked time and activation peak."""

    step_s: float = 0.0
    compute_s: float = 0.0
    peak_activation_bytes: int = 0
    trace: list[tuple[str, int, int, float, float]] = field(default_factory=list)

    @property
    def order(self) -> list[Action]:
        return [(k, i, s) for k, i, s, _, _ in self.trace]  # type: ignore[misc]


class _SavedBytes:
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


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


#: ``loss_fn(output, batch) -> scalar``: the mean loss of a (micro-)batch (a Task's ``loss``).
LossFn = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


def _cross_entropy(out: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


class StageRuntime:
    """Runs this rank's part of the model for a train step or a forward pass."""

    def __init__(self, plan: Plan, rank: int, modules: dict[int, SegmentModule],
                 transport: Transport, *, device: torch.device | None = None) -> None:
        self.plan = plan
        self.device = device or torch.device("cpu")
        self.rank = rank
        self.modules = modules
        self.transport = transport
        self.last = plan.num_segments - 1
        self.stats = StepStats()
        self._param_ptrs = {p.untyped_storage().data_ptr()
                            for m in modules.values() for p in m.parameters()}

    # ------------------------------------------------------------------ orders
    def actions(self, num_micro: int, schedule_name: str | None) -> list[Action]:
        """This rank's order: a pipeline schedule (one segment per rank) or sequential."""
        mine = sorted(self.modules)
        if not mine:
            return []
        if schedule_name is None:
            return sequential(mine, num_micro)
        if len(mine) != 1:
            raise ValueError(f"rank {self.rank} owns segments {mine}; a pipeline needs one")
        return schedule(schedule_name, mine[0], self.plan.num_segments, num_micro)

    # ------------------------------------------------------------------ training
    def train_step(self, x: torch.Tensor, y: torch.Tensor, *, step: int,
                   micro_batch_size: int | None = None,
                   schedule_name: str | None = None) -> float | None:
        """One forward/backward of the classification loss (cross-entropy) over ``(x, y)``;
        :meth:`run_batch` with ``loss_fn = CE``."""
        return self.run_batch((x, y), step=step, micro_batch_size=micro_batch_size,
                              schedule_name=schedule_name, loss_fn=_cross_entropy)

    def run_batch(self, batch: Sequence[torch.Tensor], *, step: int,
                  micro_batch_size: int | None = None, schedule_name: str | None = None,
                  loss_fn: LossFn | None = None, weight: float = 1.0,
                  precision: str = "fp32") -> float | None:
        """One forward/backward over ``batch`` (the model reads ``batch[0]``); returns the
        batch's unweighted loss on the last rank (None elsewhere).

        The batch's ``B`` rows are cut into micro-batches of ``micro_batch_size`` (None: the
        batch whole); micro-batch ``i`` (``n_i`` rows, every field of the batch sliced) has
        the loss ``L_i = loss_fn(out_i, batch_i) * weight * n_i / B``, so for a loss that is
        a mean over its rows ``sum_i L_i = weight * loss_fn(out, batch)`` and the gradients
        are those of the unpartitioned model on the whole batch. ``schedule_name=None``
        runs the sequential order (Direct/DataStore), else ``"GPipe"``/``"1F1B"``. With
        ``precision="bf16"`` each forward and the loss run under bf16 autocast.
        """
        from ...training.stepping import autocast

        loss_fn = loss_fn or _cross_entropy
        x = batch[0]
        rows = int(x.shape[0])
        sizes = micro_batch_sizes(rows, micro_batch_size or rows)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        micro = [tuple(t[bounds[i]:bounds[i + 1]] for t in batch) for i in range(len(sizes))]
        order = self.actions(len(sizes), schedule_name)
        needs = [self._recv_spec(kind, i, s, sizes[i]) for kind, i, s in order]
        post = getattr(self.transport, "post", None)
        stats = StepStats()
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        held: dict[tuple[int, int], int] = {}
        live = 0
        loss_total: float | None = None
        t_start = time.perf_counter()
        for j, (kind, i, s) in enumerate(order):
            if post is not None:
                # Post the next receives now so their payloads arrive while we compute.
                for ahead in needs[j + 1 : j + 1 + RECV_LOOKAHEAD]:
                    if ahead is not None:
                        post(src=ahead[0], key=ahead[1], step=step, rows=ahead[2])
            spec = needs[j]
            received = None if spec is None else self.transport.recv(
                src=spec[0], key=spec[1], step=step, rows=spec[2]).to(self.device)
            if kind == "F":
                if received is None:  # the first segment reads the batch
                    inp = micro[i][0]
                else:
                    inp = received
                    if inp.is_floating_point():
                        inp.requires_grad_(True)
                t0 = time.perf_counter()
                # Neither parameters nor the batch itself count as activations.
                meter = _SavedBytes(self._param_ptrs | {x.untyped_storage().data_ptr()})
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, _unpack), \
                        autocast(precision, self.device):
                    out = self.modules[s](inp)
                    if s == self.last:
                        mean = loss_fn(out, micro[i])
                        out = mean * (weight * sizes[i] / rows)
                t1 = time.perf_counter()
                stats.compute_s += t1 - t0
                stats.trace.append(("F", i, s, t0, t1))
                if s == self.last:
                    loss_total = (loss_total or 0.0) + float(mean.detach()) * sizes[i] / rows
                else:
                    self.transport.send(out.detach(), dst=self.plan.segments[s + 1].rank,
                                        key=("act", i, s + 1), step=step, rows=sizes[i])
                inputs[(i, s)], outputs[(i, s)] = inp, out
                if s > 0:  # the first stage's input is the batch itself, not an activation
                    meter.pack(inp)
                meter.pack(out)
                held[(i, s)] = meter.bytes
                live += held[(i, s)]
                stats.peak_activation_bytes = max(stats.peak_activation_bytes, live)
            else:
                out = outputs.pop((i, s))
                inp = inputs.pop((i, s))
                grad = received  # dL/d(output), None on the last segment (its output is L_i)
                t0 = time.perf_counter()
                if out.requires_grad:
                    torch.autograd.backward(out, grad_tensors=grad)
                t1 = time.perf_counter()
                stats.compute_s += t1 - t0
                stats.trace.append(("B", i, s, t0, t1))
                if s > 0:
                    g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                    self.transport.send(g, dst=self.plan.segments[s - 1].rank,
                                        key=("grad", i, s), step=step, rows=sizes[i])
                live -= held.pop((i, s))
        self.transport.flush()
        stats.step_s = time.perf_counter() - t_start
        self.stats = stats
        return loss_total

    def _recv_spec(self, kind: str, i: int, s: int, rows: int) -> tuple[int, tuple[str, int, int], int] | None:
        """``(src, key, rows)`` of the message action ``(kind, i, s)`` waits for, if any."""
        if kind == "F":
            return None if s == 0 else (self.plan.segments[s - 1].rank, ("act", i, s), rows)
        if s == self.last:
            return None
        return (self.plan.segments[s + 1].rank, ("grad", i, s + 1), rows)

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def forward(self, x: torch.Tensor, *, step: int, precision: str = "fp32") -> torch.Tensor | None:
        """Forward the whole batch through the placed model; the output on the last rank
        (under bf16 autocast with ``precision="bf16"``)."""
        from ...training.stepping import autocast

        result: torch.Tensor | None = None
        rows = int(x.shape[0])
        for s in sorted(self.modules):
            if s == 0:
                inp = x
            else:
                inp = self.transport.recv(src=self.plan.segments[s - 1].rank,
                                          key=("eval", 0, s), step=step,
                                          rows=rows).to(self.device)
            with autocast(precision, self.device):
                out = self.modules[s](inp)
            if s == self.last:
                result = out
            else:
                self.transport.send(out, dst=self.plan.segments[s + 1].rank,
                                    key=("eval", 0, s + 1), step=step, rows=rows)
        self.transport.flush()
        return result

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in sorted(self.modules) for p in self.modules[s].parameters()]

    def send_metric(self, values: torch.Tensor, *, dst: int, step: int, slot: int = 0) -> None:
        """Send a small metrics tensor (e.g. the loss) to ``dst``; ``slot`` separates kinds."""
        self.transport.send(values, dst=dst, key=("metric", slot, 0), step=step)
        self.transport.flush()

    def recv_metric(self, *, src: int, step: int, slot: int = 0) -> torch.Tensor:
        return self.transport.recv(src=src, key=("metric", slot, 0), step=step)
