"""One optimizer step of a tensor-parallel model over micro-batches.

``gradient_accumulation=True``: the micro-batches' gradients accumulate locally and the
layout's gradient reductions (sequence-parallel replicated parameters, data-parallel
averaging) run once per step. ``False``: they run after every micro-batch (what
DistributedDataParallel does without ``no_sync``), on that micro-batch's gradient only;
the result is the same, the number of collectives is ``micro_batches`` times larger.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .module import TensorParallelModule

__all__ = ["train_step"]


def train_step(
    model: TensorParallelModule,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    micro_batches: int = 1,
) -> float:
    """Forward/backward over ``micro_batches`` chunks of (x, y), sync, step; returns the
    mean loss over the whole batch (``loss_fn`` must average over its batch)."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1 (got {micro_batches})")
    optimizer.zero_grad(set_to_none=True)
    n = x.shape[0]
    accumulate = model.config.gradient_accumulation
    params = [p for p in model.parameters() if p.requires_grad]
    synced: list[torch.Tensor] | None = None
    used = [False] * len(params)  # got a gradient in some micro-batch (after the sync)
    total = 0.0
    for xc, yc in zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches),
                      strict=True):
        if xc.shape[0] == 0:
            continue
        loss = loss_fn(model(xc), yc) * (xc.shape[0] / n)
        loss.backward()
        total += float(loss.detach())
        if not accumulate and model.needs_sync:
            model.sync_gradients()
            used = [u or p.grad is not None for u, p in zip(used, params, strict=True)]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            if synced is None:
                synced = [g.clone() for g in grads]
            else:
                for s, g in zip(synced, grads, strict=True):
                    s.add_(g)
            optimizer.zero_grad(set_to_none=True)
    if accumulate or not model.needs_sync:
        model.sync_gradients()
    elif synced is not None:
        # A parameter no micro-batch (and no replica) produced a gradient for stays None,
        # so the optimizer skips it.
        for p, s, u in zip(params, synced, used, strict=True):
            p.grad = s if u else None
    optimizer.step()
    return total
