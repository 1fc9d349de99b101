"""Bucketed collectives (the DDP reducer's idea, Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB): the tensors are grouped in order
into buckets of at most ``bucket_bytes``, each flattened, all-reduced once (SUM), scaled by
``1/world`` and copied back, so ``g_i <- (1/n) sum_r g_i^(r)`` with fewer, larger messages;
:class:`GradReducer` overlaps the all-reduce with the backward pass.

Why not torch ``DistributedDataParallel``: DDP wraps a module and reduces during its one
autograd pass, while our callers hand over parameter lists whose gradients come from pipeline
micro-batches, a tensor-parallel step or a stage's replica sub-group; the mean is the same
sum-then-divide as ZeRO's reduce-scatter and the compressed exchange, whichever the job picks;
and the used-parameter flags ride with the last buckets, so a parameter no rank used keeps
``grad = None`` without DDP's ``find_unused_parameters`` graph traversal every step.
tests/comm/test_buckets_vs_ddp.py checks the means against DDP's, bit for bit on 2 ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommCounter, broadcast_, count_op, nbytes_of, world_size
from .shm import MIN_BYTES, HostArena


def bucket_bytes_of(bucket_size_mb: float) -> int:
    """``bucket_size_mb`` in bytes; MB means MiB, as in torch DDP's ``bucket_cap_mb``."""
    return max(1, int(bucket_size_mb * 1024 * 1024))


DEFAULT_BUCKET_BYTES = bucket_bytes_of(25.0)  # torch DDP's default bucket_cap_mb


def make_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int, *,
                 first_bucket_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``tensors`` grouped in order into buckets (one dtype and device each), a
    bucket closed once it holds ``bucket_bytes`` or more, as torch DDP's
    ``compute_bucket_assignment_by_size`` closes its buckets (so a tensor larger than a bucket
    joins the one being filled rather than opening one more collective: each all-reduce has
    a fixed cost, about 1 ms for gloo on 127.0.0.1). ``first_bucket_bytes`` caps the first
    (DDP uses 1 MiB, so that the gradients ready first start travelling early).
    tests/comm/test_comm_collectives.py checks the buckets against DDP's own assignment."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (got {bucket_bytes})")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    key: tuple[torch.dtype, torch.device] | None = None
    for i, t in enumerate(tensors):
        k = (t.dtype, t.device)
        if current and k != key:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes_of(t)
        key = k
        cap = first_bucket_bytes if (first_bucket_bytes is not None and not buckets) else bucket_bytes
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])  # a copy, even of one tensor


def unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in ts:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def all_reduce_buckets(tensors: Sequence[torch.Tensor], *, group: Any = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, average: bool = True,
                       counter: CommCounter | None = None) -> int:
    """In place: every tensor becomes the mean (``average=False``: the sum) over ranks; the
    flatten of bucket ``b+1`` overlaps the transfer of ``b``. Returns the all-reduces issued."""
    n = world_size(group)
    if n == 1 or not tensors:
        return 0
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    for idx in make_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in idx]
        flat = flatten(members)
        count_op(counter, "all_reduce", nbytes_of(flat))
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, members))
    for work, flat, members in pending:
        work.wait()
        if average:
            flat.div_(n)
        unflatten_into(flat, members)
    return len(pending)


def broadcast_tensors(tensors: Iterable[torch.Tensor], *, src: int = 0, group: Any = None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, counter: CommCounter | None = None) -> None:
    """In place: every rank's tensors become ``src``'s, bucketed like all-reduce."""
    ts = list(tensors)
    if world_size(group) == 1 or not ts:
        return
    for idx in make_buckets(ts, bucket_bytes):
        members = [ts[i] for i in idx]
        flat = flatten(members)
        count_op(counter, "broadcast", nbytes_of(flat))
        broadcast_(flat, src=src, group=group)
        unflatten_into(flat, members)


class GradReducer:
    """Bucketed gradient all-reduce overlapping the backward pass, as torch DDP: buckets in
    *reverse* registration order (gradients become ready from the last layer back), the first
    capped at ``first_bucket_bytes``; a post-accumulate-grad hook copies each gradient divided by
    the world size into its bucket, whose all-reduce (SUM, so the mean) starts once it and every
    earlier bucket are full; :meth:`finish` launches the rest (zeros for gradients not
    produced), waits and writes the means back (``grad = None`` where no rank used a
    parameter). ``grad_views=True``: each ``p.grad`` a view of its bucket (DDP's
    ``gradient_as_bucket_view``: no copy back). The loop drops gradients between steps
    (``zero_grad(set_to_none=True)``), so each fresh gradient is copied into its slot once, as
    DDP's reducer does: zeroing the buckets and accumulating into them costs a memset and an add
    per step instead (~10% of an 8 MB MLP's step, benchmarks/data_parallel.py).

    Buckets go out in index order on every rank, as DDP's reducer launches them, whatever order
    their gradients become ready in: a branch taken on one rank only fills buckets in another
    order there, and gloo pairs collectives by order (equal sizes would sum the wrong buckets
    silently; tests/comm/test_comm_grad_sync.py).

    Which parameters some rank used travels in the buckets themselves: each bucket ends with
    one flag per member (1 where this rank produced its gradient), summed with the gradients,
    so the rule costs no collective of its own (DDP's ``find_unused_parameters=True`` all-reduces
    a separate bitmap every step)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, group: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, first_bucket_bytes: int | None = 1024 * 1024,
                 counter: CommCounter | None = None, grad_views: bool = False) -> None:
        self.grad_views = grad_views
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.counter = counter
        self.n = world_size(group)
        self._scale = 1.0 / self.n
        order = list(reversed(self.params))
        first = None if first_bucket_bytes is None else min(first_bucket_bytes, bucket_bytes)
        self.buckets = [[order[i] for i in idx]
                        for idx in make_buckets(order, bucket_bytes, first_bucket_bytes=first)]
        self._flat: list[torch.Tensor] = []
        self._flags: list[torch.Tensor] = []  # each bucket's tail: its members' used flags
        # id(p) -> (its bucket, its slot there shaped as p): made once, not sliced from the bucket
        # at every hook and write-back (a step's Python is what separates this loop from DDP's C++)
        self._slot: dict[int, tuple[int, torch.Tensor]] = {}
        # On one host the buckets above shm.MIN_BYTES live in shared memory and are summed there
        # (.shm: gloo's TCP loopback costs several copies of each); the others go through gloo
        sizes_of = [sum(p.numel() for p in m) + len(m) for m in self.buckets]
        big = [b for b, m in enumerate(self.buckets)
               if sizes_of[b] * m[0].element_size() > MIN_BYTES and m[0].device.type == "cpu"]
        self._arena = HostArena.create([(sizes_of[b], self.buckets[b][0].dtype) for b in big],
                                       group) if self.n > 1 else None
        self._shared = {b: i for i, b in enumerate(big)} if self._arena is not None else {}
        for b, members in enumerate(self.buckets):
            sizes = [p.numel() for p in members]
            flat = self._arena.slot(self._shared[b]) if self._arena is not None and b in self._shared else torch.zeros(
                sum(sizes) + len(members), dtype=members[0].dtype, device=members[0].device)
            self._flat.append(flat)
            self._flags.append(flat[sum(sizes):])
            for p, slot in zip(members, torch.split(flat[:sum(sizes)], sizes), strict=True):
                self._slot[id(p)] = (b, slot.view_as(p))
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the first bucket not launched: buckets go out in index order
        self._seen: set[int] = set()
        self._work: list[Any] = [None] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
                         for p in self.params]
        self._accumulated: set[int] = set()
        self.enabled = True
        """False during the accumulation backwards of a step (DDP's ``no_sync``): hooks only
        note which gradients exist; :meth:`finish` reduces what was accumulated."""

    def _hook(self, p: torch.Tensor) -> None:
        if self.n == 1 or p.grad is None:
            return
        if not self.enabled:
            # An accumulation backward (no_sync): remember the gradient exists, so a
            # parameter used only in an earlier batch of the step still counts as used.
            self._accumulated.add(id(p))
            return
        if id(p) in self._seen:
            return
        self._seen.add(id(p))
        b, slot = self._slot[id(p)]
        # Divided by the world size while copied into the bucket, as DDP's reducer (one pass
        # over the gradient, not a copy and then a division of the reduced bucket); the sum
        # of the slots is then the mean, bit for bit DDP's.
        if p.grad.data_ptr() != slot.data_ptr():  # not (yet) a view of the bucket
            torch.mul(p.grad, self._scale, out=slot)
            if self.grad_views:  # as DDP: the autograd buffer is freed now, not after the step
                p.grad = slot
        else:
            slot.mul_(self._scale)
        self._ready[b] += 1
        # Only in index order, as DDP's reducer: ranks whose gradients become ready in
        # different orders (a branch taken on some) still pair the same buckets.
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._flags[self._next].fill_(1)
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        count_op(self.counter, "all_reduce", nbytes_of(self._flat[b]))
        self._work[b] = (self._arena.all_reduce(self._shared[b]) if self._arena is not None and b in self._shared
                         else dist.all_reduce(self._flat[b], group=self.group, async_op=True))

    def finish(self) -> None:
        """Complete the reduction of this step; ``p.grad`` holds the mean over ranks."""
        if self.n == 1:
            return
        # Parameters whose gradient came only from the step's earlier (no_sync) backwards:
        # their bucket slots are filled now, as their hook would have.
        self.enabled = True
        for p in self.params:
            if id(p) in self._accumulated and id(p) not in self._seen:
                self._hook(p)
        self._accumulated.clear()
        for b, members in enumerate(self.buckets):
            if self._work[b] is None:
                # Some parameters produced no gradient (unused this step): their share is 0.
                for i, p in enumerate(members):
                    seen = id(p) in self._seen
                    if not seen:
                        self._slot[id(p)][1].zero_()
                    self._flags[b][i] = 1 if seen else 0
                self._launch(b)
        for b, members in enumerate(self.buckets):
            self._work[b].wait()
            used = (self._flags[b] > 0).tolist()  # the slots are already the mean (_hook)
            for i, p in enumerate(members):
                view = self._slot[id(p)][1]
                if not used[i]:
                    p.grad = None  # the optimizer skips it
                elif self.grad_views:  # p.grad becomes a view of the bucket: no copy back
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._seen.clear()
        self._work = [None] * len(self.buckets)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._arena is not None:
            self._arena.close()
