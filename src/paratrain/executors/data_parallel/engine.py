"""The DataParallel replica's engine for the one training loop (ZeRO's is
:class:`~paratrain.executors.shared.zero.ZeroEngine`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...comm import collectives as C
from ...comm.context import WorkerContext
from ...training.loop import LocalEngine
from ...training.stepping import local_grad_sq_norm
from .aggregation import Aggregator


class DataParallelEngine(LocalEngine):
    """A replica: the task's forward/backward on this rank's batch, then the aggregator
    combines (``sync``). Under ``grad_accumulation`` the bucketed AllReduce hooks stay
    quiet until the step's last backward (DDP's ``no_sync``), so one exchange per step."""

    def __init__(self, model: nn.Module, task: Any, test: Any, *, ctx: WorkerContext,
                 precision: str, agg: Aggregator, counter: C.CommCounter,
                 local: set[str] | None = None) -> None:
        super().__init__(model, task, test, device=ctx.device, precision=precision)
        self.ctx, self.agg, self.counter = ctx, agg, counter
        self.local = local or set()  # parameter names of Local subgraphs
        self.zero_grad_set_to_none = agg.zero_grad_set_to_none
        self.consensus: list[float] = []

    def forward_backward(self, batch: Any, *, weight: float, last: bool) -> float:
        self.agg.begin_backward(last=last)
        return super().forward_backward(batch, weight=weight, last=last)

    def sync(self) -> None:
        self.agg.sync_gradients()

    def grad_sq_norm(self) -> float:
        """With Local subgraphs, ``||g_shared||^2 + mean_r ||g_local,r||^2`` (the same on every
        rank, so clipping keeps the shared parameters equal); else the base norm."""
        if not self.local:
            return super().grad_sq_norm()
        named = list(self.model.named_parameters())
        shared = float(local_grad_sq_norm(p for n, p in named if n not in self.local))
        return shared + self.mean_over_ranks(float(local_grad_sq_norm(p for n, p in named if n in self.local)))

    def after_step(self) -> dict[str, float]:
        extra = self.agg.after_step()
        if "consensus_distance" in extra:
            self.consensus.append(extra["consensus_distance"])
        return extra

    def evaluate(self) -> dict[str, float] | None:
        return super().evaluate() if self.ctx.is_main else None

    def mean_over_ranks(self, value: float) -> float:
        if self.ctx.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        C.all_reduce_(t, group=self.ctx.group)
        return float(t.item()) / self.ctx.world_size

    def log_extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {"comm_bytes": self.counter.total_bytes}
        if self.consensus:
            out["consensus_distance"] = self.consensus[-1]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"aggregator": self.agg.state_dict(), "comm": dict(self.counter.bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.agg.load_state_dict(state["aggregator"])
        for k, v in state["comm"].items():
            self.counter.bytes[k] = int(v)
