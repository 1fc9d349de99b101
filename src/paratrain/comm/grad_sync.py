"""The one data-parallel gradient sync, :class:`GradSync` (DataParallel's AllReduce, TP x
DataParallel's dp side, the replicated pipeline stage), with DDP's ``find_unused_parameters`` rule:
a parameter no rank used keeps ``grad = None``, others are combined with zeros, so a branch taken on
one replica never hands the collective different tensors (a wrong sum, or a hang).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .buckets import DEFAULT_BUCKET_BYTES, GradReducer, all_reduce_buckets, broadcast_tensors
from .collectives import CommCounter, global_rank, used_mask, world_size


def drop_unused(named: Sequence[tuple[str, torch.nn.Parameter]], *, group: Any = None,
                counter: CommCounter | None = None) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters some rank of ``group`` produced a gradient for (one MAX all-reduce of
    flags); every other one gets ``grad = None``."""
    used = used_mask([p.grad is not None for _, p in named], group=group, counter=counter)
    live = []
    for (n, p), u in zip(named, used, strict=True):
        if u:
            live.append((n, p))
        else:
            p.grad = None
    return live


class GradSync:
    """Combine the replicas' gradients over ``group``: a bucketed all-reduce of the mean (or the
    sum, ``average=False``, for a replicated stage whose losses are already weighted by rows), or a
    compressed exchange (:mod:`paratrain.comm.ddp_hook`). :meth:`before_forward` before each forward
    of a step (``last``: its last), :meth:`sync` after the last backward. ``params``: ``(name,
    parameter)`` pairs in one order on every rank (the names key the compressor's residuals);
    ``buffers``: what :meth:`before_forward` broadcasts (DDP's ``broadcast_buffers``)."""

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], *, group: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = False, average: bool = True,
                 compressor: Any = None, buffers: Sequence[torch.Tensor] = (),
                 counter: CommCounter | None = None) -> None:
        if compressor is not None and not average:
            raise ValueError("GradSync: a compressed exchange averages (average=False is a sum)")
        self.named = [(n, p) for n, p in params if p.requires_grad]
        self.group = group
        self.n = world_size(group)
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.average = average
        self.compressor = compressor
        self.counter = counter if counter is not None else CommCounter()
        self.buffers = list(buffers)
        self._src = int(global_rank(group, 0)) if self.n > 1 else 0
        self._step_open = False  # a forward of this step already ran (buffers broadcast)
        self.reducer: GradReducer | None = None
        if overlap and compressor is None and self.n > 1 and self.named:
            self.reducer = GradReducer([p for _, p in self.named], group=group,
                                       bucket_bytes=self.bucket_bytes, counter=self.counter,
                                       grad_views=True)

    def before_forward(self, *, last: bool = True) -> None:
        """Before each forward of a step: the step's first broadcasts the buffers; the
        overlapped buckets launch during the step's ``last`` backward only (DDP's ``no_sync``)."""
        if not self._step_open:
            self._step_open = True
            self.broadcast_buffers()
        if self.reducer is not None:
            self.reducer.enabled = last

    def broadcast_buffers(self) -> None:
        """The buffers become the group's first rank's (bucketed broadcasts)."""
        if self.n > 1 and self.buffers:
            broadcast_tensors(self.buffers, src=self._src, group=self.group,
                              bucket_bytes=self.bucket_bytes, counter=self.counter)

    def sync(self) -> int:
        """After the step's last backward: every used parameter's ``grad`` is the mean (or
        sum) over the group, an unused one's None. Returns the collectives issued."""
        self._step_open = False
        if self.n == 1 or not self.named:
            return 0
        if self.reducer is not None:
            self.reducer.finish()
            return len(self.reducer.buckets) + 1
        if self.compressor is not None:
            return self._sync_compressed()
        # The used flags travel in the last bucket with the gradients (zeros where unused).
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.named]
        ref = grads[-1]
        flags = torch.tensor([p.grad is not None for _, p in self.named], dtype=ref.dtype,
                             device=ref.device)
        issued = all_reduce_buckets([*grads, flags], group=self.group, bucket_bytes=self.bucket_bytes,
                                    average=self.average, counter=self.counter)
        for (_, p), g, used in zip(self.named, grads, flags.tolist(), strict=True):
            p.grad = g if used != 0 else None
        return issued

    def _sync_compressed(self) -> int:
        from .ddp_hook import allreduce_compressed

        live = drop_unused(self.named, group=self.group, counter=self.counter)
        if self.compressor.powersgd is not None:
            # One PowerSGD exchange in DDP's rebuilt-bucket order (gradient-ready order,
            # reverse registration for a sequential model), so fresh Q draws match
            # torch's powerSGD_hook on a model whose gradients fit one DDP bucket.
            live = live[::-1]
        means = allreduce_compressed(
            self.compressor, [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in live],
            group=self.group, counter=self.counter)
        for (_, p), m in zip(live, means, strict=True):
            p.grad = m
        self.compressor.step()
        return 2

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (error-feedback residuals, its step); empty without one."""
        return {"compressor": self.compressor.state_dict()} if self.compressor is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.compressor is not None and "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])

    def close(self) -> None:
        """Remove the overlapped reducer's hooks."""
        if self.reducer is not None:
            self.reducer.remove()
