"""The placed model's forward pass on a whole batch (evaluation): no micro-batches, no gradients.

Each stage's primary replica runs its parts in part order on the whole batch: it reads the
model's arguments (every rank reads the batch), sends each parameter another rank reads
(a tie across workers) and each output another rank reads, and receives what it reads
from other ranks, all under the ``("eval", 0, slot)`` keys; the rank of the loss part
returns the model's output. Other replicas of a stage take no part.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .feed import batch_rows, model_inputs, model_output
from .values import as_tuple, slot_of

__all__ = ["Inference"]


class Inference:
    """Mixin of :class:`.runtime.StageRuntime`: its forward pass for evaluation."""

    cut: Any
    transport: Any
    replicas: Any
    replica: int
    attrs: dict[str, torch.Tensor]
    modules: dict[int, nn.Module]
    parts: dict[int, Any]
    reads: dict[int, list[str]]
    in_transfers: dict[str, Any]
    out_transfers: list[Any]
    loss_part: int | None
    device: torch.device

    def _is_attr(self, v: str) -> bool:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, *args: Any, step: int, precision: str = "fp32", **kwargs: Any) -> Any:
        """The placed model called as ``model(*args, **kwargs)`` on a whole batch; the output
        on the loss part's rank (None elsewhere; under bf16 autocast with ``precision="bf16"``)."""
        from ...training.stepping import autocast

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
