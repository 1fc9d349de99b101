"""The tensor-parallel (x data-parallel) part of the one loop: :class:`TensorParallelEngine`.

A batch (the same on every rank of a TP group) runs in ``micro_batches`` chunks, each
backpropagating ``weight * (n_chunk / n) * loss(chunk)``; the gradient reductions run once per
step, or after every micro-batch with ``gradient_accumulation = false``. ``grad_sq_norm`` is the
whole model's on every rank: a parameter held by ``f`` of the ``tp`` ranks (1 for a column/row
shard, ``g`` for a 2-D grid bias) adds ``||g||^2 / f`` to a sum all-reduced over TP; a
replicated one is added locally once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...comm.collectives import world_mean
from ...task.steps import call_model
from ...tensor_parallel import TensorParallelModule
from ...tensor_parallel.grid import replicas_of
from ...tensor_parallel.shards import dense_names_and_shards
from ...training.loop import Batch, LocalEngine, batch_size_of
from ...training.stepping import autocast


def _split(batch: Batch, parts: int) -> list[Batch]:
    """``batch`` (a pytree) in ``parts`` row chunks (leaves that are not batch-first go whole)."""
    n = batch_size_of(batch)
    if parts <= 1 or n <= 1:
        return [batch]
    leaves, spec = tree_flatten(batch)
    cols = [torch.tensor_split(t, parts) if isinstance(t, torch.Tensor) and t.dim() > 0
            and t.shape[0] == n else None for t in leaves]
    return [tree_unflatten([c[i] if c is not None else t for c, t in zip(cols, leaves, strict=True)], spec)
            for i in range(parts)]


class TensorParallelEngine(LocalEngine):
    """One rank of a tensor-parallel (x data-parallel) job."""

    def __init__(self, model: TensorParallelModule, task: Any, test: Any, *,
                 device: torch.device, precision: str = "fp32", micro_batches: int = 1,
                 is_main: bool = True, backend: str = "gloo") -> None:
        super().__init__(model, task, test, device=device, precision=precision)
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1 (got {micro_batches})")
        self.tpm = model
        self.micro_batches = micro_batches
        self.is_main = is_main
        self.grad_sync = model.grad_sync  # the data-parallel side (None: one replica)
        self.reduce_device = device if backend == "nccl" else None
        self.per_micro_sync = (not model.config.gradient_accumulation) and model.needs_sync
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._synced: list[torch.Tensor] | None = None
        self._used = [False] * len(self._params)
        self._names, self._shards = dense_names_and_shards(model, rank=model.comm.rank)

    def forward_backward(self, batch: Batch, *, weight: float, last: bool) -> float:
        if self.grad_sync is not None:
            self.grad_sync.before_forward(last=last)  # the step's first: DDP's buffer broadcast
        n = batch_size_of(batch)
        total = 0.0
        for chunk in _split(batch, self.micro_batches):
            m = batch_size_of(chunk)
            if m == 0:
                continue
            scale = weight * (m / n) if n else weight
            with autocast(self.precision, self.device):
                loss = self.task.loss(call_model(self.task, self.model, chunk), chunk)
            (loss * scale).backward() if scale != 1.0 else loss.backward()
            total += (m / n if n else 1.0) * float(loss.detach())
            if self.per_micro_sync:
                self._sync_micro_batch()
        return total

    def _sync_micro_batch(self) -> None:
        """Reduce this micro-batch's gradients now and add them to the step's sum."""
        self.tpm.sync_gradients()
        params = self._params
        self._used = [u or p.grad is not None for u, p in zip(self._used, params, strict=True)]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self._synced is None:
            self._synced = [g.detach().clone() for g in grads]
        else:
            for s, g in zip(self._synced, grads, strict=True):
                s.add_(g)
        for p in params:
            p.grad = None

    def sync(self) -> None:
        if not self.per_micro_sync:
            self.tpm.sync_gradients()
            return
        if self._synced is not None:
            # a parameter no micro-batch (and no replica) produced a gradient for stays None
            for p, s, u in zip(self._params, self._synced, self._used, strict=True):
                p.grad = s if u else None
        self._synced, self._used = None, [False] * len(self._params)

    def grad_sq_norm(self) -> float:
        tp = self.tpm.comm.size
        sharded = torch.zeros(1, dtype=torch.float64, device=self.device)
        replicated = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self._params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            f = replicas_of(p, tp)
            if f >= tp:
                replicated += sq
            else:
                sharded += sq / f
        if tp > 1:
            sharded = self.tpm.comm.all_reduce(sharded)  # collective over the TP group
        return float((sharded + replicated).item())

    def evaluate(self) -> dict[str, float] | None:
        ev = super().evaluate()  # every rank: the forward has TP collectives
        return ev if self.is_main else None

    def mean_over_ranks(self, value: float) -> float:
        return world_mean([value], self.reduce_device)[0]

    def log_extras(self) -> dict[str, Any]:
        st = self.tpm.statistics()
        return {"collectives": st["total_collectives"],
                "payload_bytes_measured": st["payload_bytes_measured"],
                "bytes_sent_modelled": st["bytes_sent_modelled"]}

    def model_names(self) -> dict[str, str]:
        """This rank's keys -> the dense model's names."""
        return self._names

    def model_shards(self) -> dict[str, dict[str, Any]]:
        """The keys holding part of a dense tensor -> where (:mod:`paratrain.tensor_parallel.shards`)."""
        return self._shards

    def state_dict(self) -> dict[str, Any]:
        return {"aggregator": self.grad_sync.state_dict() if self.grad_sync is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.grad_sync is not None:
            self.grad_sync.load_state_dict(state.get("aggregator", {}))
