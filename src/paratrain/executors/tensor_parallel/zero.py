"""ZeRO x tensor parallelism on one ``dp x tp`` mesh: :class:`MeshZeroEngine`.

Each rank of a DataParallel job with ``shard`` (``D x T`` processes, :mod:`.runner`) holds its
tensor-parallel shard of the model; ZeRO (Rajbhandari et al. 2020,
:class:`~paratrain.executors.shared.zero.ZeroEngine`) runs over the *dp* column on those
tensors, each of the ``D`` ranks keeping rows ``[d c, (d+1) c)`` of dim 0 of every tensor (``c =
ceil(rows / D)``); the TP group's collectives still carry activations only. The ZeRO mean over
dp and the TP sums of replicated parameters (sequence-parallel or BatchWise regions) are linear
maps along the two mesh axes, so they commute: the TP sum runs on the owned rows after ZeRO's
mean. The global gradient norm (pytorch#180346, accelerate#4219: a norm over one group only, or
counting replicas twice, is wrong): every rank adds ``||g_rows||^2 / f`` per owned row block,
``f`` the ranks of the TP group holding the same tensor, and one all-reduce over the whole mesh
sums it to ``||g_model||^2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ...comm import collectives as C
from ...comm.tp.groups import TPGroups
from ...tensor_parallel import TensorParallelModule
from ...tensor_parallel.grid import replicas_of
from ...tensor_parallel.shards import dense_names_and_shards
from ...training.loop import Batch, batch_size_of
from ...training.stepping import autocast
from ..shared.zero import ShardView, ZeroEngine, resolve_units
from .engine import _split


@dataclass
class _Column:
    """The dp column of the mesh as ZeroEngine's world (rank = the dp index)."""

    rank: int
    world_size: int
    group: Any
    device: torch.device
    is_main: bool


def mesh_units(tpm: TensorParallelModule, patterns: Sequence[str] | None) -> list[str]:
    """The ZeRO units as paths of ``tpm`` (``module.<path>``), resolved as in DataParallel."""
    return [f"module.{p}" for p in resolve_units(tpm.module, patterns)]


def compose_spec(tp_spec: dict[str, Any] | None, rows: dict[str, Any] | None,
                 shape: Sequence[int]) -> dict[str, Any] | None:
    """Where ZeRO's rows of a TP tensor lie in the dense tensor: the TP slices, with the
    rows ``[start, start + length)`` of dimension 0 of the TP tensor moved into the dense
    one (``[0, a, n]`` then rows ``[s, s + l)`` is ``[0, a + s, l]``; one slice per dim)."""
    if rows is None:
        return tp_spec
    if tp_spec is None:
        return {"shape": list(shape), "slices": [list(s) for s in rows["slices"]]}
    slices = [list(s) for s in tp_spec["slices"]]
    for dim, start, length in rows["slices"]:
        at = next((s for s in slices if s[0] == dim), None)
        if at is None:
            slices.append([dim, start, length])
        else:
            at[1], at[2] = at[1] + start, length
    return {"shape": list(tp_spec["shape"]), "slices": sorted(slices)}


class MeshZeroEngine(ZeroEngine):
    """ZeRO at ``level`` over the dp column of a ``dp x tp`` mesh, on this rank's TP shard."""

    def __init__(self, tpm: TensorParallelModule, task: Any, test: Any, *, groups: TPGroups,
                 device: torch.device, is_main: bool, world_group: Any, precision: str, level: str,
                 units: Sequence[str] | None, micro_batches: int, broadcast_buffers: bool,
                 counter: C.CommCounter, bucket_bytes: int) -> None:
        column = _Column(rank=groups.tp_index, world_size=groups.dp_size,
                         group=groups.dp.group if groups.dp is not None else None,
                         device=device, is_main=is_main)
        paths = mesh_units(tpm, units) if level != "optimizer" else None
        super().__init__(tpm, task, test, ctx=column, precision=precision,  # type: ignore[arg-type]
                         level=level, units=paths, local=set(),
                         buffers=list(tpm.module.buffers()) if broadcast_buffers else [],
                         counter=counter, bucket_bytes=bucket_bytes)
        self.tpm, self.groups, self.world_group = tpm, groups, world_group
        self.is_main = is_main
        self.micro_batches = max(1, int(micro_batches))
        tp = groups.tp_size
        # this rank's pieces with the TP replication of the tensor each is cut from
        self._owned = [(piece, replicas_of(p, tp)) for u in self.units
                       for piece, p in zip(u.pieces, u.params, strict=True) if piece is not None]
        sp = {id(p) for p in tpm._sp_params}
        self._sp_pieces = [piece for u in self.units for piece, p in zip(u.pieces, u.params, strict=True)
                           if piece is not None and id(p) in sp]
        dense, tp_specs = dense_names_and_shards(tpm, rank=tpm.comm.rank)
        view = cast(ShardView, self.model)  # mangled key -> tpm's state_dict name, ZeRO row specs
        shapes = dict(tpm.state_dict(keep_vars=True))
        self._names = {k: dense[n] for k, n in view.names.items()}
        self._specs: dict[str, Any] = {}
        for k, n in view.names.items():
            spec = compose_spec(tp_specs.get(n), view.specs.get(k), shapes[n].shape)
            if spec is not None:
                self._specs[k] = spec

    def forward_backward(self, batch: Batch, *, weight: float, last: bool) -> float:
        """The batch in ``tensor_parallel.micro_batches`` chunks, each backpropagating
        ``weight * (n_chunk / n) * loss(chunk)``."""
        n = batch_size_of(batch)
        chunks = [c for c in _split(batch, self.micro_batches) if batch_size_of(c) > 0] or [batch]
        total = 0.0
        for i, chunk in enumerate(chunks):
            share = batch_size_of(chunk) / n if n else 1.0
            total += share * super().forward_backward(chunk, weight=weight * share,
                                                      last=last and i == len(chunks) - 1)
        return total

    def sync(self) -> None:
        """ZeRO's mean over dp into the owned rows, then the TP sums on those rows."""
        super().sync()
        grads = [p.grad for p in self._sp_pieces if p.grad is not None]
        if grads:
            self.tpm.comm.all_reduce_coalesced_(grads)

    def grad_sq_norm(self) -> float:
        """The whole model's squared gradient norm (module doc), the same on every rank."""
        t = torch.zeros(1, dtype=torch.float64, device=self.device)
        for piece, f in self._owned:
            if piece.grad is not None:
                t += piece.grad.detach().double().pow(2).sum() / f
        C.all_reduce_(t, group=self.world_group, counter=self.counter)
        return float(t.item())

    def evaluate(self) -> dict[str, float] | None:
        """Every rank evaluates (the forward runs TP collectives); rank 0's metrics."""
        from ...task.steps import evaluate as evaluate_task

        self.gather_all()
        try:
            with autocast(self.precision, self.device):
                ev = evaluate_task(self.net, self.task, self.test, device=self.device)
        finally:
            self.free_all()
        return ev if self.is_main else None

    def log_extras(self) -> dict[str, Any]:
        st = self.tpm.statistics()
        return {"comm_bytes": self.counter.total_bytes, "collectives": st["total_collectives"]}

    def model_names(self) -> dict[str, str]:
        """This rank's keys -> the dense model's names."""
        return dict(self._names)

    def model_shards(self) -> dict[str, dict[str, Any]]:
        """The composed TP x ZeRO shard specs (module doc)."""
        return dict(self._specs)
