"""``TPComm``: the collectives of one tensor-parallel group under one communication pattern. The
sum-all-reduce (equal up to float summation order): ``AllReduce`` one ``all_reduce``; ``AllGather``
gathered partials summed in rank order; ``ReduceScatter`` a ``reduce_scatter`` then ``all_gather``
(activations stay sequence-sharded between blocks); ``PointToPoint`` an ``isend``/``irecv`` ring,
2(p-1) steps; ``Hierarchical`` a ``reduce`` to the host's leader, an ``all_reduce`` among leaders, a
``broadcast`` back. :class:`CommStats` counts every call by type, at the call:
``payload_bytes_measured`` (the tensors this rank hands over) and ``bytes_sent_modelled`` (the ring
cost model: all_reduce 2(p-1)/p n; all_gather, reduce_scatter, broadcast, reduce (p-1)/p n; send n:
the backend's algorithm is not visible from here), the time spent waiting, the compute time the
layers book, and ``replayed`` collectives a recomputation read back from its tape instead.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..buckets import flatten, unflatten_into
from ..collectives import all_gather_flat, nbytes_of, reduce_scatter_flat
from ..messages import batch_exchange

PATTERNS = ("AllReduce", "AllGather", "ReduceScatter", "PointToPoint", "Hierarchical")


class CommStats:
    """The counters of the module docstring, kept at each call (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()  # ring-model wire bytes (modelled)
        self.payload: Counter[str] = Counter()  # sizes of the tensors handed over (measured)
        self.comm_time_s = 0.0
        self.compute_time_s = 0.0
        self.async_launched = 0  # collectives started without blocking (overlappable)
        # forward collectives a recomputation read back from a tape instead of running
        # (tensor_parallel.memory): not sent, so in none of the counts above
        self.replayed = 0

    def record(self, kind: str, wire_bytes: float, seconds: float = 0.0, *, payload_bytes: int = 0) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.bytes[kind] += int(round(wire_bytes))
            self.payload[kind] += int(payload_bytes)
            self.comm_time_s += seconds

    def launched_async(self) -> None:
        with self._lock:
            self.async_launched += 1

    def replayed_collective(self) -> None:
        with self._lock:
            self.replayed += 1

    def add_comm_time(self, seconds: float) -> None:
        with self._lock:
            self.comm_time_s += seconds

    def add_compute_time(self, seconds: float) -> None:
        with self._lock:
            self.compute_time_s += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "collectives": dict(self.counts),
                "bytes_sent_by_type_modelled": dict(self.bytes),
                "payload_bytes_by_type_measured": dict(self.payload),
                "total_collectives": sum(self.counts.values()),
                "bytes_sent_modelled": sum(self.bytes.values()),
                "payload_bytes_measured": sum(self.payload.values()),
                "communication_time_s": self.comm_time_s,
                "computation_time_s": self.compute_time_s,
                "async_collectives": self.async_launched,
                "replayed_collectives": self.replayed,
            }


class Handle:
    """An in-flight collective; ``wait()`` returns its result and books the exposed time."""

    def __init__(self, stats: CommStats, *, work: Any = None, future: Future[Any] | None = None,
                 result: Any = None, finish: Callable[[], Any] | None = None) -> None:
        self._stats, self._work, self._future = stats, work, future
        self._result, self._finish = result, finish
        self._done = work is None and future is None

    def wait(self) -> Any:
        if not self._done:
            t0 = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            if self._future is not None:
                self._result = self._future.result()
            self._stats.add_comm_time(time.perf_counter() - t0)
            self._done = True
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


@dataclass
class _Hier:
    intra: Any  # process group of my node
    intra_ranks: list[int]
    inter: Any | None  # leaders' group (only on leaders, None if a single node)
    leader: int  # global rank of my node's leader
    layout: str = ""  # e.g. "flat (1 host)", "2 local groups of 2 (2 hosts)"


class TPComm:
    """Collectives over one process group with one communication pattern (``group=None``,
    ``size == 1``: one process, every op the identity)."""

    def __init__(self, group: Any, ranks: Sequence[int], *, rank: int, pattern: str = "AllReduce",
                 async_op: bool = True, fusion_threshold_bytes: int = 0,
                 stats: CommStats | None = None, hier: _Hier | None = None) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown communication pattern {pattern!r}; valid: {PATTERNS}")
        self.group, self.ranks = group, list(ranks)
        self.size = len(self.ranks)
        self.global_rank = rank
        self.rank = self.ranks.index(rank)
        self.pattern, self.async_op = pattern, async_op
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.stats = stats if stats is not None else CommStats()
        self._hier = hier
        self.hierarchy = hier.layout if hier is not None else None
        self._pool: ThreadPoolExecutor | None = None

    def _timed(self, kind: str, wire: float, fn: Callable[[], Any], payload: int = 0) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.stats.record(kind, wire, time.perf_counter() - t0, payload_bytes=payload)
        return out

    def _call(self, kind: str, wire: float, payload: int, fn: Callable[[bool], Any], async_op: bool) -> Any:
        """``fn(async_op)`` recorded: the work when launched asynchronously (its wait is booked
        by the :class:`Handle`), else timed here."""
        if async_op:
            self.stats.record(kind, wire, payload_bytes=payload)
            self.stats.launched_async()
            return fn(True)
        return self._timed(kind, wire, lambda: fn(False), payload)

    def _native_all_reduce(self, t: torch.Tensor, group: Any, p: int, async_op: bool = False) -> Any:
        return self._call("all_reduce", 2 * (p - 1) / p * nbytes_of(t), nbytes_of(t),
                          lambda a: dist.all_reduce(t, group=group, async_op=a), async_op)

    def all_gather(self, t: torch.Tensor, dim: int, sizes: Sequence[int] | None = None,
                   *, async_op: bool = False) -> Handle:
        """All-gather along ``dim``; ``sizes`` are the per-rank lengths (may differ)."""
        if self.size == 1:
            return Handle(self.stats, result=t)
        p, async_op = self.size, async_op and self.async_op
        sizes = list(sizes) if sizes is not None else [t.shape[dim]] * p
        if sizes[self.rank] != t.shape[dim]:
            raise ValueError(f"rank {self.rank}: local length {t.shape[dim]} != {sizes[self.rank]}")
        m = max(sizes)
        x = _pad_rows(t.movedim(dim, 0), m).contiguous()
        out = x.new_empty((p * m, *x.shape[1:]))

        def finish() -> torch.Tensor:
            parts = [out[i * m: i * m + sizes[i]] for i in range(p)]
            return torch.cat(parts).movedim(0, dim).contiguous()

        work = self._call("all_gather", (p - 1) * nbytes_of(x), nbytes_of(x),
                          lambda a: all_gather_flat(out, x, self.group, a), async_op)
        return Handle(self.stats, work=work if async_op else None, finish=finish)

    def reduce_scatter(self, t: torch.Tensor, dim: int, sizes: Sequence[int] | None = None,
                       *, async_op: bool = False) -> Handle:
        """Reduce-scatter (sum) along ``dim`` into chunks of ``sizes`` (default: ceil-sized)."""
        if self.size == 1:
            return Handle(self.stats, result=t)
        p, async_op = self.size, async_op and self.async_op
        n = t.shape[dim]
        sizes = list(sizes) if sizes is not None else ceil_sizes(n, p)
        if sum(sizes) != n:
            raise ValueError(f"reduce_scatter sizes {sizes} do not add up to {n}")
        m = max(sizes)
        inp = torch.cat([_pad_rows(c, m) for c in torch.split(t.movedim(dim, 0), sizes)]).contiguous()
        out = inp.new_empty((m, *inp.shape[1:]))
        mine = sizes[self.rank]

        def finish() -> torch.Tensor:
            return out[:mine].movedim(0, dim).contiguous()

        work = self._call("reduce_scatter", (p - 1) * nbytes_of(out), nbytes_of(inp),
                          lambda a: reduce_scatter_flat(out, inp, self.group, a), async_op)
        return Handle(self.stats, work=work if async_op else None, finish=finish)

    def _ring_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        p, r = self.size, self.rank
        flat = t.reshape(-1).clone()
        chunk = list(torch.split(flat, ceil_sizes(flat.numel(), p)))

        def exchange(send_i: int, recv_i: int, accumulate: bool) -> None:
            buf = torch.empty_like(chunk[recv_i])
            t0 = time.perf_counter()
            batch_exchange({(r + 1) % p: chunk[send_i].contiguous()}, {(r - 1) % p: buf}, group=self.group)
            dt = time.perf_counter() - t0
            if chunk[send_i].numel():
                self.stats.record("send", nbytes_of(chunk[send_i]), dt,
                                  payload_bytes=nbytes_of(chunk[send_i]))
            if buf.numel():
                self.stats.record("recv", 0)
            if accumulate:
                chunk[recv_i].add_(buf)
            else:
                chunk[recv_i].copy_(buf)

        for s in range(p - 1):
            exchange((r - s) % p, (r - s - 1) % p, True)
        for s in range(p - 1):
            exchange((r - s + 1) % p, (r - s) % p, False)
        return flat.view_as(t)

    def _hier_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        h = self._hier
        assert h is not None
        out = t.clone()
        q = len(h.intra_ranks)
        if q > 1:
            self._timed("reduce", (q - 1) / q * nbytes_of(out),
                        lambda: dist.reduce(out, dst=h.leader, group=h.intra), nbytes_of(out))
        if h.inter is not None:
            n_lead = dist.get_world_size(h.inter)
            self._native_all_reduce(out, h.inter, n_lead)
        if q > 1:
            self._timed("broadcast", (q - 1) / q * nbytes_of(out),
                        lambda: dist.broadcast(out, src=h.leader, group=h.intra),
                        nbytes_of(out) if self.global_rank == h.leader else 0)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group with this comm's pattern (out of place)."""
        if self.size == 1:
            return t
        if self.pattern == "AllReduce":
            out = t.clone()
            self._native_all_reduce(out, self.group, self.size)
            return out
        if self.pattern == "AllGather":
            return torch.sum(self.all_gather(t.unsqueeze(0), 0).wait(), 0)
        if self.pattern == "ReduceScatter":
            flat = t.reshape(-1)
            sizes = ceil_sizes(flat.numel(), self.size)
            part = self.reduce_scatter(flat, 0, sizes).wait()
            return torch.reshape(self.all_gather(part, 0, sizes).wait(), t.shape)
        if self.pattern == "PointToPoint":
            return self._ring_all_reduce(t)
        return self._hier_all_reduce(t)

    def all_reduce_async(self, t: torch.Tensor) -> Handle:
        """Start a sum-all-reduce; overlaps with the caller's work when ``async_op``."""
        if self.size == 1:
            return Handle(self.stats, result=t)
        if not self.async_op:
            return Handle(self.stats, result=self.all_reduce(t))
        if self.pattern == "AllReduce":
            out = t.clone()
            work = self._native_all_reduce(out, self.group, self.size, async_op=True)
            return Handle(self.stats, work=work, result=out)
        if self._pool is None:  # composite patterns run on one helper thread, in order
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp-comm")
        self.stats.launched_async()
        return Handle(self.stats, future=self._pool.submit(self.all_reduce, t))

    def broadcast_(self, t: torch.Tensor, src_index: int = 0) -> torch.Tensor:
        """In-place broadcast from the member at group index ``src_index``."""
        if self.size > 1:
            self._timed("broadcast", (self.size - 1) / self.size * nbytes_of(t),
                        lambda: dist.broadcast(t, src=self.ranks[src_index], group=self.group),
                        nbytes_of(t) if self.rank == src_index else 0)
        return t

    def all_reduce_coalesced_(self, tensors: Sequence[torch.Tensor], *, average: bool = False) -> int:
        """Sum (or average) ``tensors`` in place, those under ``fusion_threshold_bytes`` packed
        into buffers of at most that size; returns the number of all-reduces."""
        if self.size == 1 or not tensors:
            return 0
        thr = self.fusion_threshold_bytes
        buckets: list[list[torch.Tensor]] = []
        cur: list[torch.Tensor] = []
        cur_bytes = 0
        for t in tensors:
            b = nbytes_of(t)
            if b >= thr or thr == 0:
                buckets.append([t])
                continue
            if cur and (cur_bytes + b > thr or cur[0].dtype != t.dtype):
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(t)
            cur_bytes += b
        if cur:
            buckets.append(cur)
        pending: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []
        for bucket in buckets:
            flat = flatten(bucket)
            work = self._native_all_reduce(flat, self.group, self.size, async_op=self.async_op)
            pending.append((bucket, flat, work))
        t0 = time.perf_counter()
        for bucket, flat, work in pending:
            if self.async_op:
                work.wait()
            if average:
                flat.div_(self.size)
            unflatten_into(flat, bucket)
        if self.async_op:
            self.stats.add_comm_time(time.perf_counter() - t0)
        return len(buckets)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``m`` rows (dim 0)."""
    return x if x.shape[0] >= m else torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])


def ceil_sizes(n: int, p: int) -> list[int]:
    """Ceil-sized chunk lengths of ``n`` over ``p`` slots (zeros at the end)."""
    per = -(-n // p) if n else 0
    return [max(0, min(per, n - i * per)) for i in range(p)]
