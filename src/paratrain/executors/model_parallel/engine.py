"""One ModelParallel rank's part of the one training loop (:class:`PipelineEngine`), its parts
as one module (:class:`StageModel`) and ZeRO inside a replicated stage (:class:`StageZero`,
``shard`` on a ``[subgraphs.<path>]`` DataParallel: each of the stage's replicas steps only
its rows of every parameter, the exchange once per step after its last backward, ZeRO-3
gathering once at the step's first forward; docs/model-parallel.md says why). The update
equals the unsharded stage's (element-wise optimizers); a checkpoint holds each replica's rows
under the model's names with their specs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ...comm import collectives as C
from ...comm.buckets import DEFAULT_BUCKET_BYTES
from ...comm.context import WorkerContext
from ...comm.grad_sync import GradSync
from ...comm.zero import FlatShard
from ...config import ConfigError
from ...graph.partition import Part
from ...task.steps import DEFAULT_EVAL_BATCH, fetch_batch
from ...training.loop import LocalEngine
from ...training.stepping import local_grad_sq_norm
from ..shared.zero import (
    LEVELS,
    ShardView,
    Unit,
    free_unit,
    gather_rows,
    gather_unit,
    held_bytes,
    keep_own_rows,
    shard_view,
)
from .plan import Plan
from .runtime import StageRuntime
from .schedule import theoretical_bubble


class StageModel(nn.Module):
    """This rank's parts as one module (what its optimizer steps and checkpoint holds), plus
    the tensors it holds for ``get_attr`` reads; a rank owning no parameter keeps an empty
    placeholder, so its optimizer and scheduler exist like every other rank's."""

    def __init__(self, modules: dict[int, nn.Module],
                 attrs: dict[str, torch.Tensor] | None = None,
                 parts: Sequence[Part] = ()) -> None:
        super().__init__()
        self.segments = nn.ModuleDict({str(i): m for i, m in sorted(modules.items())})
        # part index -> the part (its tensors' names as the model has them)
        self._parts = {p.index: p for p in parts}
        inside = {id(p) for m in modules.values() for p in m.parameters()}
        inside |= {id(b) for m in modules.values() for b in m.buffers()}
        self.held = nn.Module()
        for name, t in sorted((attrs or {}).items()):
            if id(t) in inside:
                continue
            if isinstance(t, nn.Parameter):
                self.held.register_parameter(name, t)
            else:
                self.held.register_buffer(name, t)
        empty = not any(True for m in modules.values() for _ in m.parameters()) and not list(
            self.held.parameters())
        self.placeholder = nn.Parameter(torch.zeros(0)) if empty else None

    def model_names(self, targets: dict[str, str] | None = None) -> dict[str, str]:
        """This module's ``state_dict`` keys -> the tensors' names in the model (``targets``:
        a held value's name -> the model attribute it reads)."""
        out: dict[str, str] = {}
        for i, m in self.segments.items():
            part = self._parts.get(int(i))
            for k in m.state_dict():
                out[f"segments.{i}.{k}"] = part.original_name(k) if part is not None else k
        for k in self.held.state_dict():
            out[f"held.{k}"] = (targets or {}).get(k, k)
        return out

    def node_state(self, targets: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """This rank's model tensors by their names in the model (:meth:`model_names`: the
        same whatever the placement; a tensor read by two parts once)."""
        names = self.model_names(targets)
        out: dict[str, torch.Tensor] = {}
        for k, v in self.state_dict().items():
            if k in names:
                out.setdefault(names[k], v)
        return out


def compose_spec(outer: dict[str, Any] | None, inner: dict[str, Any] | None) -> dict[str, Any] | None:
    """The spec of ``inner``'s piece of a tensor that is itself ``outer``'s piece of the model's
    tensor (slices compose as successive ``narrow``s, :mod:`paratrain.training.reshard`)."""
    if outer is None or inner is None:
        return outer if inner is None else inner
    return {"shape": list(outer["shape"]), "slices": [*outer["slices"], *inner["slices"]]}


class StageZero:
    """ZeRO-``level`` over ``group`` (the stage's replicas) for ``stage`` (module doc):
    :attr:`view` is what the optimizer steps and the checkpoint holds."""

    def __init__(self, stage: nn.Module, *, level: str, group: Any, where: str,
                 device: torch.device) -> None:
        self.level = LEVELS[level]
        self.group, self.device = group, device
        self.world, rank = C.world_size(group), C.rank_of(group)
        # an empty parameter (a stage that owns none keeps an empty placeholder) has no rows
        named = [(k, p) for k, p in stage.named_parameters() if p.requires_grad and p.numel() > 0]
        flat0 = [k for k, p in named if p.dim() == 0]
        if flat0:
            raise ConfigError([(f"subgraphs.{where}.shard", (
                f"stage parameter {flat0[0]} is 0-dimensional: it has no rows to shard; make "
                "it shape [1] or leave shard = \"none\""))])
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for k, p in named:
            by_dtype.setdefault(p.dtype, []).append((k, p))
        self.units = [Unit(str(dt), ps, FlatShard([p.shape for _, p in ps], world=self.world, rank=rank))
                      for dt, ps in by_dtype.items()]
        self.view: ShardView = shard_view(stage, self.units)
        if not list(self.view.parameters()):  # no rows here: an optimizer still needs a parameter
            self.view.add("placeholder", nn.Parameter(torch.zeros(0, device=device)))
        self.params = [p for u in self.units for p in u.params]
        self._new_step = True
        if self.level == 3:
            for u in self.units:
                keep_own_rows(u, device)

    def pieces(self) -> Iterator[tuple[nn.Parameter, nn.Parameter, int]]:
        """``(piece, whole parameter, first row)`` of every row range this replica steps."""
        for u in self.units:
            for piece, p, fp in zip(u.pieces, u.params, u.flat.pieces, strict=True):
                if piece is not None:
                    yield piece, p, fp.start

    def begin(self, counter: C.CommCounter | None = None) -> None:
        """Before a step's first forward: last step's whole gradients dropped; ZeRO-3 gathers."""
        if self._new_step:
            self._new_step = False
            for p in self.params:
                p.grad = None
            for u in self.units:
                u.grad = None
            self.unshard(counter)

    def unshard(self, counter: C.CommCounter | None = None) -> None:
        """ZeRO-3: the replicas' rows all-gathered into the whole parameters (collective)."""
        for u in self.units:
            gather_unit(u, group=self.group, counter=counter)

    def reshard(self) -> None:
        """ZeRO-3: the whole parameters freed; this replica keeps its rows in ``u.shard``."""
        for u in self.units:
            free_unit(u)

    def sync(self, counter: C.CommCounter | None = None) -> None:
        """After the step's last backward (ZeRO-1: after the sum's all-reduce): each piece's
        ``grad`` is its rows of the replicas' summed gradient, None where no replica used
        the parameter this step."""
        self._new_step = True
        if self.level == 1:
            for piece, p, start in self.pieces():
                piece.grad = None if p.grad is None else p.grad.detach()[start : start + piece.shape[0]]
            return
        flags = [p.grad is not None for p in self.params]
        used = iter(C.used_mask(flags, group=self.group, counter=counter) if flags else [])
        for u in self.units:
            u.grad = torch.empty(u.flat.numel, dtype=u.params[0].dtype, device=self.device)
            u.flat.reduce_scatter([p.grad for p in u.params], u.grad, group=self.group,
                                  counter=counter, average=False)
            for i, (maybe, whole) in enumerate(zip(u.pieces, u.params, strict=True)):
                live = next(used)
                whole.grad = None  # the whole gradient is dropped: this replica keeps its rows
                if maybe is not None:
                    maybe.grad = u.flat.view(u.grad, i) if live else None
        self.reshard()  # ZeRO-3: the optimizer steps the rows only

    def gather(self, counter: C.CommCounter | None = None) -> None:
        """ZeRO-1/2: :func:`gather_rows` (after each step and a resume); ZeRO-3 keeps its rows
        until the next :meth:`begin`."""
        if self.level < 3:
            gather_rows(self.units, group=self.group, counter=counter, device=self.device)

    def names(self, stage_names: dict[str, str]) -> dict[str, str]:
        """The view's keys -> the model's names (``stage_names``: the stage's keys -> them)."""
        return {k: stage_names.get(v, v) for k, v in self.view.names.items()}

    def shards(self, stage_shards: dict[str, Any]) -> dict[str, Any]:
        """The view's keys -> their specs: this replica's rows, after the stage key's own
        tensor-parallel spec where it has one."""
        out: dict[str, Any] = {}
        for k, v in self.view.names.items():
            spec = compose_spec(stage_shards.get(v), self.view.specs.get(k))
            if spec is not None:
                out[k] = spec
        return out

    def held_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this replica holds for the stage now (:func:`held_bytes`; rows where sharded)."""
        return held_bytes([*self.params, *(u.shard for u in self.units if u.shard is not None)],
                          optimizer, grads=[u.grad for u in self.units])


class PipelineEngine(LocalEngine):
    """One rank's part of the one loop: its actions of the schedule per batch (the batch's
    loss on the last stage's rank, 0.0 elsewhere), the global gradient norm (the stages' sums
    of squares all-reduced), and evaluation and the training loss handed to rank 0 (the
    logging process) by the last stage; keeps the per-rank totals the summary reports."""

    def __init__(self, ctx: WorkerContext, rt: StageRuntime, model: StageModel, task: Any,
                 test: Any, *, precision: str, micro_batch_size: int | None,
                 schedule_name: str | None, replica_group: Any = None,
                 broadcast_buffers: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 shard: str = "none", where: str = "") -> None:
        super().__init__(model, task, test, device=ctx.device, precision=precision)
        self.ctx, self.rt, self.stage = ctx, rt, model
        self.replica_group = replica_group  # None: the stage is not replicated
        self.zero = (StageZero(model, level=shard, group=replica_group, where=where, device=ctx.device)
                     if replica_group is not None and shard != "none" else None)
        if self.zero is not None:
            self.model = self.zero.view
        # A replicated stage sums its replicas' gradients (each its rows' share, weighted
        # n_ij / B) after the step's last backward (a parameter used by some replicas only
        # is summed with zeros from the others). Under ZeRO-2/3 the sum is StageZero's
        # reduce-scatter and GradSync only broadcasts buffers.
        summed = list(model.named_parameters()) if self.zero is None or self.zero.level == 1 else []
        self.replica_sync = (GradSync(
            summed, group=replica_group, bucket_bytes=bucket_bytes,
            average=False, buffers=list(model.buffers()) if broadcast_buffers else [])
            if replica_group is not None else None)
        self.micro_batch_size, self.schedule_name = micro_batch_size, schedule_name
        self.last_rank = rt.plan.last_rank
        # message steps (unique for DataStore): forward_backward calls, evaluations, metrics
        self._calls = self._evals = self._msgs = 0
        self._step_started: float | None = None
        self.step_times: list[float] = []
        # step, compute and blocked-in-recv seconds, peak activation bytes, bytes sent, steps,
        # and (set at the end by record_held) bytes of parameters, gradients, optimizer state
        self.totals = torch.zeros(9, dtype=torch.float64)

    def model_names(self) -> dict[str, str]:
        """The stage's keys -> the model's names (checkpoints resumable on another placement)."""
        names = self.stage.model_names({a.name: a.target for a in self.rt.cut.attrs})
        return names if self.zero is None else self.zero.names(names)

    def stage_shards(self) -> dict[str, Any]:
        """The stage's keys holding part of a model tensor -> their specs (tensor parallel)."""
        return {}

    def model_shards(self) -> dict[str, Any]:
        """The checkpointed keys holding part of a model tensor -> their specs."""
        own = self.stage_shards()
        return own if self.zero is None else self.zero.shards(own)

    def norm_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """``(tensor with a grad, its stage parameter)`` whose squared norms sum to this rank's
        share of the model's: a replicated stage's first replica only, or each ZeRO replica's
        own rows."""
        if self.zero is not None:
            return [(piece, p) for piece, p, _ in self.zero.pieces()]
        return [(p, p) for p in self.model.parameters()] if self.rt.replica == 0 else []

    def _counter(self) -> C.CommCounter | None:
        return self.replica_sync.counter if self.replica_sync is not None else None

    def forward_backward(self, batch: Any, *, weight: float, last: bool) -> float:
        if self.zero is not None:
            self.zero.begin(self._counter())
        if self.replica_sync is not None:
            self.replica_sync.before_forward(last=last)  # the step's first: buffers as DDP's
        if self._step_started is None:
            self._step_started = time.perf_counter()
        tr: Any = self.rt.transport
        w0, b0 = tr.wait_s, tr.bytes_sent
        loss = self.rt.run_batch(batch, step=self._calls, micro_batch_size=self.micro_batch_size,
                                 schedule_name=self.schedule_name, loss_fn=self.task.loss,
                                 weight=weight, precision=self.precision)
        self._calls += 1
        st = self.rt.stats
        self.totals[:3] += torch.tensor([st.step_s, st.compute_s, tr.wait_s - w0], dtype=torch.float64)
        self.totals[3] = max(float(self.totals[3]), st.peak_activation_bytes)
        self.totals[4] += tr.bytes_sent - b0
        if self.replica_group is not None and self.rt.loss_part in self.rt.parts:
            # each replica of the last stage holds its rows' share: the batch loss is the sum
            part = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64)
            C.all_reduce_(part, group=self.replica_group)
            loss = float(part[0])
        return 0.0 if loss is None else loss

    def sync(self) -> None:
        if self.replica_sync is not None:
            self.replica_sync.sync()
        if self.zero is not None:
            self.zero.sync(self._counter())

    def grad_sq_norm(self) -> float:
        total = local_grad_sq_norm([t for t, _ in self.norm_pieces()]).to(C.comm_device(self.ctx.group))
        if self.ctx.world_size > 1:
            C.all_reduce_(total, group=self.ctx.group)
        return float(total)

    def after_step(self) -> dict[str, float]:
        if self.zero is not None:  # every replica's updated rows into the whole parameters
            self.zero.gather(self._counter())
        if self._step_started is not None:
            self.step_times.append(time.perf_counter() - self._step_started)
        self._step_started = None
        self.totals[5] += 1
        return {}

    def record_held(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`StageZero.held_bytes` or the stage's into :attr:`totals`."""
        held = (self.zero.held_bytes(optimizer) if self.zero is not None
                else held_bytes(self.stage.parameters(), optimizer))
        self.totals[6:9] = torch.tensor([held["parameters"], held["gradients"], held["optimizer"]],
                                        dtype=torch.float64)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After a resume loaded this replica's rows: :meth:`StageZero.gather`."""
        del state
        if self.zero is not None:
            self.zero.gather()

    def unshard(self) -> None:
        """The stage's whole parameters (ZeRO-3 gathers them: every replica calls this)."""
        if self.zero is not None:
            self.zero.unshard(self._counter())

    def _to_rank0(self, payload: torch.Tensor | None) -> torch.Tensor | None:
        """The last stage's ``payload`` on rank 0 (and on the last stage); None elsewhere.
        Under pipeline x TP ``ctx.rank`` is the stage's and the ranks are its lane's: a
        stage's first replica speaks for it."""
        self._msgs += 1
        if self.last_rank == 0:
            return payload
        first = self.rt.replicas.of
        if self.ctx.rank == self.last_rank and self.rt.replica == 0:
            assert payload is not None
            self.rt.send_metric(payload, dst=first(0)[0], step=self._msgs, slot=1)
            return payload
        if self.ctx.rank == 0:
            return self.rt.recv_metric(src=first(self.last_rank)[0], step=self._msgs, slot=1)
        return None

    def mean_over_ranks(self, value: float) -> float:
        mine = torch.tensor([value], dtype=torch.float64) if self.ctx.rank == self.last_rank else None
        got = self._to_rank0(mine)
        return value if got is None else float(got.double()[0])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        self.stage.eval()
        bs = int(getattr(self.task, "eval_batch_size", None) or DEFAULT_EVAL_BATCH)
        n = len(self.test)
        sums: dict[str, float] = {}
        self.unshard()  # ZeRO-3: whole for the evaluation only
        try:
            for a in range(0, n, bs):
                batch = fetch_batch(self.test, torch.arange(a, min(a + bs, n)), self.device)
                args, kwargs = self.rt.feed(batch)
                out = self.rt.forward(*args, step=self._evals, precision=self.precision, **kwargs)
                self._evals += 1
                if out is not None:
                    for k, v in self.task.eval_batch(out, batch).items():
                        sums[k] = sums.get(k, 0.0) + float(v)
        finally:
            self.stage.train()
            if self.zero is not None:
                self.zero.reshard()
        payload = None
        if self.ctx.rank == self.last_rank:
            sums.setdefault("count", 0.0)
            metrics = {k: float(v) for k, v in self.task.finalize(sums).items()}
            payload = torch.frombuffer(bytearray(json.dumps(metrics).encode()), dtype=torch.uint8)
        got = self._to_rank0(payload)
        if self.ctx.rank != 0 or got is None:
            return None
        result: dict[str, float] = json.loads(bytes(got.cpu().numpy().tobytes()).decode())
        return result


def pipeline_stats(totals: list[torch.Tensor], plan: Plan, *, micro_batches: int | None,
                   schedule: str = "1F1B") -> dict[str, Any]:
    """Per-rank time split and the run's bubble from each rank's step totals:
    ``bubble_fraction_measured = 1 - C_max / T`` (``C_max`` the busiest rank's compute, ``T``
    the longest rank's step time, over the run: the bottleneck stage's idle time, as GPipe and
    Megatron count it); for a Pipeline ``bubble_theory_modelled``, the ``schedule``'s ideal
    (:func:`.schedule.theoretical_bubble`)."""
    steps = max(float(totals[0][5]), 1.0)
    step_s = max(float(t[0]) for t in totals)
    busiest = max(float(t[1]) for t in totals)
    out: dict[str, Any] = {
        "stage_stats": [
            {"rank": r, "compute_fraction_measured": round(float(t[1]) / max(float(t[0]), 1e-12), 4),
             "blocked_in_recv_fraction_measured": round(float(t[2]) / max(float(t[0]), 1e-12), 4),
             "peak_activation_bytes_measured": int(t[3]),
             "bytes_sent_per_step_measured": round(float(t[4]) / steps, 1),
             "held_bytes_measured": {"parameters": int(t[6]), "gradients": int(t[7]),
                                     "optimizer": int(t[8])}}
            for r, t in enumerate(totals)
        ],
        "bubble_fraction_measured": round(1.0 - busiest / step_s, 4) if step_s > 0 else None,
    }
    if micro_batches is not None:
        p = max(len(plan.cut.ranks()), 1)
        out["bubble_theory_modelled"] = round(theoretical_bubble(
            p, micro_batches, schedule, max(plan.num_segments // p, 1)), 4)
    return out
