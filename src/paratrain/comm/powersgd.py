"""PowerSGD over torch.distributed (the maths: :mod:`paratrain.compression.powersgd`): an
exchange all-reduces (SUM) ``[uncompressed values | P = M Q]``, asynchronously, then ``Q = M^T
orthogonalize(P)``; the means are the uncompressed ``/ W`` and ``P_hat (Q / W)^T``. torch's
``powerSGD_hook`` all-reduces three times per bucket: the uncompressed values ride with P here,
same bytes, one latency fewer. Before ``start_step`` a plain mean all-reduce (DDP's arithmetic:
divide, then sum). ``counter`` books ``itemsize * (sum r'(n+m) + uncompressed numel)`` a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from ..compression.powersgd import PowerSGDRound, PowerSGDState
from .collectives import CommCounter, count_op, nbytes_of, world_size

Named = Sequence[tuple[str, torch.Tensor]]


def _plain(named: Named, group: Any, world: int, counter: CommCounter | None
           ) -> torch.futures.Future[list[torch.Tensor]]:
    flat = torch.cat([t.detach().reshape(-1) for _, t in named]).div_(world)

    def split(_f: Any = None) -> list[torch.Tensor]:
        parts = torch.split(flat, [t.numel() for _, t in named])
        return [p.view(t.shape) for p, (_, t) in zip(parts, named, strict=True)]

    if world == 1:
        done: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        done.set_result(split())
        return done
    count_op(counter, "all_reduce", nbytes_of(flat))
    return cast("torch.futures.Future[list[torch.Tensor]]", dist.all_reduce(flat, group=group, async_op=True).get_future().then(split))


def launch_powersgd(state: PowerSGDState, named: Named, *, group: Any = None, counter: CommCounter | None = None,
                    out: Sequence[torch.Tensor] | None = None) -> torch.futures.Future[list[torch.Tensor]]:
    """Start one exchange; the future's value is each tensor's mean (approximation) in
    ``named`` order, written into ``out`` when given. Every rank passes the same names,
    shapes and order."""
    world = world_size(group)
    if not named:
        done: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        done.set_result([])
        return done
    if not state.active():
        return _plain(named, group, world, counter)  # (the DDP hook reduces its bucket itself)
    rnd: PowerSGDRound = state.begin(named)
    if world == 1:
        rnd.second()
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result(rnd.finish(1, out))
        return fut
    count_op(counter, "all_reduce", nbytes_of(rnd.first))
    first = dist.all_reduce(rnd.first, group=group, async_op=True).get_future()

    def after_first(_f: Any) -> torch.Tensor:
        q = rnd.second()
        count_op(counter, "all_reduce", nbytes_of(q))
        # Blocking inside the callback, as torch's hook does: the chain stays one future.
        dist.all_reduce(q, group=group, async_op=True).get_future().wait()
        return q

    return cast("torch.futures.Future[list[torch.Tensor]]", first.then(after_first).then(lambda _f: rnd.finish(world, out)))


def allreduce_powersgd(state: PowerSGDState, named: Named, *, group: Any = None,
                       counter: CommCounter | None = None) -> list[torch.Tensor]:
    """:func:`launch_powersgd`, blocking, on the caller's thread (no future callbacks)."""
    world = world_size(group)
    if not named or world == 1 or not state.active():
        return launch_powersgd(state, named, group=group, counter=counter).wait()
    rnd = state.begin(named)
    count_op(counter, "all_reduce", nbytes_of(rnd.first))
    dist.all_reduce(rnd.first, group=group)
    q = rnd.second()
    count_op(counter, "all_reduce", nbytes_of(q))
    dist.all_reduce(q, group=group)
    return rnd.finish(world)


def mean_bucket(buf: torch.Tensor, group: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP bucket's mean with DDP's own arithmetic: divide by the world size, then sum."""
    buf.div_(world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return cast("torch.futures.Future[torch.Tensor]", fut.then(lambda f: f.value()[0]))


def powersgd_bucket_hook(state: PowerSGDState, bucket: Any, names: list[str], group: Any,
                         counter: CommCounter | None = None) -> torch.futures.Future[torch.Tensor]:
    """One DDP bucket (``dist.GradBucket``) through PowerSGD, keyed by ``names`` (one per
    bucket gradient): the means are written back into the bucket buffer. A bucket is one
    exchange (one fresh-Q seed draw, as torch's hook per bucket)."""
    buf: torch.Tensor = bucket.buffer()
    if not state.active():
        return mean_bucket(buf, group)
    grads = bucket.gradients()
    fut = launch_powersgd(state, list(zip(names, grads, strict=True)), group=group,
                          counter=counter, out=grads)
    return fut.then(lambda _f: buf)
