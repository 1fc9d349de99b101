"""Collectives for tensor parallelism: groups, per-pattern implementations, fusion, statistics,
and the autograd-aware region operators of Megatron-LM.

References: Shoeybi et al. 2019, "Megatron-LM" (the f/g conjugate operators: f = identity
forward / all-reduce backward before a column-parallel layer, g = all-reduce forward /
identity backward after a row-parallel one); Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (sequence parallelism: g becomes a
reduce-scatter along the sequence dimension and f an all-gather, conjugate in backward).

Layout of groups (torchtitan / Megatron convention): with ``tp`` tensor-parallel ranks and
``dp = world / tp`` data-parallel replicas, the TP group of rank r is the ``tp`` consecutive
ranks ``[r//tp*tp, r//tp*tp + tp)`` and its DP group the ranks ``r % tp + k*tp``.

A *pattern* (``TensorCommunicationPattern``) decides how the sum-all-reduce of the TP
region is carried out; every pattern gives the same numbers (up to float summation order):

- ``AllReduce``: one ``all_reduce``.
- ``AllGather``: ``all_gather`` of the partials, then a local sum in rank order.
- ``ReduceScatter``: ``reduce_scatter`` + ``all_gather`` (and the layers keep activations
  sequence-sharded between blocks, see ``tensor_parallel.layers``).
- ``PointToPoint``: a ring all-reduce made of ``isend``/``irecv`` (reduce-scatter ring then
  all-gather ring, 2(p-1) steps).
- ``Hierarchical``: the TP group's ranks on one host form a node (the real topology, see
  :func:`paratrain.comm.groups.hierarchy_from_hosts`; ``LOCAL_WORLD_SIZE`` under torchrun);
  ``reduce`` to the node leader, ``all_reduce`` among leaders, ``broadcast`` back inside the
  node. On one host without ``LOCAL_WORLD_SIZE`` the layout is flat: one node, so a reduce
  and a broadcast (``TPComm.hierarchy`` says ``"flat (1 host)"``).

Statistics count every torch.distributed call by type, at the call, with two byte figures:
``payload_bytes_measured``, the sizes of the tensors this rank hands to the calls (the input
of an all-reduce or reduce, the shard of an all-gather, the full input of a reduce-scatter,
the chunk of a send, the tensor of a broadcast it is the source of; receive buffers are not
counted), and ``bytes_sent_modelled``, what this rank puts on the wire under the ring cost
model (all_reduce 2(p-1)/p n, all_gather / reduce_scatter (p-1)/p n of the full tensor,
broadcast / reduce (p-1)/p n, send n), since the backend's own algorithm is not visible
from here. Point-to-point sends are the one case where both are the same measured count.
Also the time spent waiting on communication.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

__all__ = [
    "PATTERNS",
    "CommStats",
    "Handle",
    "TPComm",
    "TPGroups",
    "build_tp_groups",
    "copy_to_region",
    "reduce_from_region",
    "gather_from_region",
    "scatter_to_region",
    "seq_gather",
    "seq_reduce_scatter",
    "fused_copy_to_region",
    "fused_seq_gather",
    "column_linear",
    "row_linear",
    "world_barrier",
    "world_mean",
    "broadcast_int",
    "broadcast_module_",
]

PATTERNS = ("AllReduce", "AllGather", "ReduceScatter", "PointToPoint", "Hierarchical")


class CommStats:
    """Real counters, kept at each torch.distributed call: calls by type, the payload bytes
    this rank handed to them (measured), the bytes it sends under the ring model (modelled),
    comm and compute time."""

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

    def record(self, kind: str, wire_bytes: float, seconds: float = 0.0, *, payload_bytes: int = 0) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.bytes[kind] += int(round(wire_bytes))
            self.payload[kind] += int(payload_bytes)
            self.comm_time_s += seconds

    def launched_async(self) -> None:
        with self._lock:
            self.async_launched += 1

    def add_comm_time(self, seconds: float) -> None:
        with self._lock:
            self.comm_time_s += seconds

    def add_compute_time(self, seconds: float) -> None:
        with self._lock:
            self.compute_time_s += seconds

    @property
    def total_collectives(self) -> int:
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        """Ring-model bytes sent (modelled)."""
        return sum(self.bytes.values())

    @property
    def total_payload_bytes(self) -> int:
        """Bytes of the tensors handed to the calls (measured)."""
        return sum(self.payload.values())

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


# Newer torch names these ``*_single``; older ones ``*_tensor``; older gloo builds have
# neither collective, so the fallbacks below use list all-gather / all-reduce + slice.
_AG = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_RS = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_NATIVE = {"all_gather": _AG is not None, "reduce_scatter": _RS is not None}


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool) -> Any:
    """``out`` = concatenation of every rank's ``x`` along dim 0."""
    if _NATIVE["all_gather"]:
        try:
            return _AG(out, x, group=group, async_op=async_op)  # type: ignore[misc]
        except (RuntimeError, NotImplementedError):  # backend without the flat form
            _NATIVE["all_gather"] = False
    parts = list(out.chunk(dist.get_world_size(group)))
    work = dist.all_gather(parts, x, group=group, async_op=async_op)
    return work


def _reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    """``out`` = this rank's chunk (dim 0) of the sum of every rank's ``inp``."""
    if _NATIVE["reduce_scatter"]:
        try:
            return _RS(out, inp, group=group, async_op=async_op)  # type: ignore[misc]
        except (RuntimeError, NotImplementedError):  # e.g. gloo without reduce_scatter
            _NATIVE["reduce_scatter"] = False
    full = inp.clone()
    dist.all_reduce(full, group=group)
    out.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Hier:
    intra: Any  # process group of my node
    intra_ranks: list[int]
    inter: Any | None  # leaders' group (only on leaders, None if a single node)
    leader: int  # global rank of my node's leader
    layout: str = ""  # e.g. "flat (1 host)", "2 local groups of 2 (2 hosts)"


class TPComm:
    """Collectives over one process group, carried out with one communication pattern.

    ``group=None`` with ``size == 1`` is the single-process case: every op is the identity.
    """

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

    # -- primitive calls (each records itself) ------------------------------------------
    def _timed(self, kind: str, wire: float, fn: Callable[[], Any], payload: int = 0) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.stats.record(kind, wire, time.perf_counter() - t0, payload_bytes=payload)
        return out

    def _native_all_reduce(self, t: torch.Tensor, group: Any, p: int, async_op: bool = False) -> Any:
        wire = 2 * (p - 1) / p * _nbytes(t)
        if async_op:
            self.stats.record("all_reduce", wire, payload_bytes=_nbytes(t))
            self.stats.launched_async()
            return dist.all_reduce(t, group=group, async_op=True)
        return self._timed("all_reduce", wire, lambda: dist.all_reduce(t, group=group), _nbytes(t))

    def _gather_padded(self, t: torch.Tensor, dim: int, sizes: Sequence[int] | None,
                       async_op: bool = False) -> Handle:
        """All-gather along ``dim``; ``sizes`` are the per-rank lengths (may differ)."""
        p = self.size
        sizes = list(sizes) if sizes is not None else [t.shape[dim]] * p
        if sizes[self.rank] != t.shape[dim]:
            raise ValueError(f"rank {self.rank}: local length {t.shape[dim]} != {sizes[self.rank]}")
        m = max(sizes)
        x = t.movedim(dim, 0)
        if x.shape[0] < m:
            x = torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
        x = x.contiguous()
        out = x.new_empty((p * m, *x.shape[1:]))
        wire = (p - 1) * _nbytes(x)

        def finish() -> torch.Tensor:
            parts = [out[i * m: i * m + sizes[i]] for i in range(p)]
            return torch.cat(parts).movedim(0, dim).contiguous()

        if async_op:
            self.stats.record("all_gather", wire, payload_bytes=_nbytes(x))
            self.stats.launched_async()
            work = _all_gather_flat(out, x, self.group, True)
            return Handle(self.stats, work=work, finish=finish)
        self._timed("all_gather", wire, lambda: _all_gather_flat(out, x, self.group, False), _nbytes(x))
        return Handle(self.stats, finish=finish)

    def _reduce_scatter_padded(self, t: torch.Tensor, dim: int, sizes: Sequence[int] | None,
                               async_op: bool = False) -> Handle:
        p = self.size
        n = t.shape[dim]
        sizes = list(sizes) if sizes is not None else _ceil_sizes(n, p)
        if sum(sizes) != n:
            raise ValueError(f"reduce_scatter sizes {sizes} do not add up to {n}")
        m = max(sizes)
        x = t.movedim(dim, 0)
        chunks, start = [], 0
        for s in sizes:
            c = x[start:start + s]
            if s < m:
                c = torch.cat([c, c.new_zeros((m - s, *c.shape[1:]))])
            chunks.append(c)
            start += s
        inp = torch.cat(chunks).contiguous()
        out = inp.new_empty((m, *inp.shape[1:]))
        wire = (p - 1) * _nbytes(out)
        mine = sizes[self.rank]

        def finish() -> torch.Tensor:
            return out[:mine].movedim(0, dim).contiguous()

        if async_op:
            self.stats.record("reduce_scatter", wire, payload_bytes=_nbytes(inp))
            self.stats.launched_async()
            work = _reduce_scatter_flat(out, inp, self.group, True)
            return Handle(self.stats, work=work, finish=finish)
        self._timed("reduce_scatter", wire,
                    lambda: _reduce_scatter_flat(out, inp, self.group, False), _nbytes(inp))
        return Handle(self.stats, finish=finish)

    def _ring_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        p, r = self.size, self.rank
        flat = t.reshape(-1).clone()
        sizes = _ceil_sizes(flat.numel(), p)
        starts = [sum(sizes[:i]) for i in range(p)]
        chunk = [flat[starts[i]: starts[i] + sizes[i]] for i in range(p)]
        right, left = self.ranks[(r + 1) % p], self.ranks[(r - 1) % p]

        def exchange(send_i: int, recv_i: int, accumulate: bool) -> None:
            buf = torch.empty_like(chunk[recv_i])
            t0 = time.perf_counter()
            ops = []
            if chunk[send_i].numel():
                ops.append(dist.P2POp(dist.isend, chunk[send_i].contiguous(), right, self.group))
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, left, self.group))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            dt = time.perf_counter() - t0
            if chunk[send_i].numel():
                self.stats.record("send", _nbytes(chunk[send_i]), dt,
                                  payload_bytes=_nbytes(chunk[send_i]))
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
            self._timed("reduce", (q - 1) / q * _nbytes(out),
                        lambda: dist.reduce(out, dst=h.leader, group=h.intra), _nbytes(out))
        if h.inter is not None:
            n_lead = dist.get_world_size(h.inter)
            self._native_all_reduce(out, h.inter, n_lead)
        if q > 1:
            self._timed("broadcast", (q - 1) / q * _nbytes(out),
                        lambda: dist.broadcast(out, src=h.leader, group=h.intra),
                        _nbytes(out) if self.global_rank == h.leader else 0)
        return out

    def _all_reduce_now(self, t: torch.Tensor) -> torch.Tensor:
        if self.pattern == "AllReduce":
            out = t.clone()
            self._native_all_reduce(out, self.group, self.size)
            return out
        if self.pattern == "AllGather":
            g = self._gather_padded(t.unsqueeze(0), 0, None).wait()
            return g.sum(0)
        if self.pattern == "ReduceScatter":
            flat = t.reshape(-1)
            sizes = _ceil_sizes(flat.numel(), self.size)
            part = self._reduce_scatter_padded(flat, 0, sizes).wait()
            return self._gather_padded(part, 0, sizes).wait().view_as(t)
        if self.pattern == "PointToPoint":
            return self._ring_all_reduce(t)
        return self._hier_all_reduce(t)

    # -- public API -------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group with this comm's pattern (out of place)."""
        if self.size == 1:
            return t
        return self._all_reduce_now(t)

    def all_reduce_async(self, t: torch.Tensor) -> Handle:
        """Start a sum-all-reduce; overlaps with the caller's work when ``async_op``."""
        if self.size == 1:
            return Handle(self.stats, result=t)
        if not self.async_op:
            return Handle(self.stats, result=self._all_reduce_now(t))
        if self.pattern == "AllReduce":
            out = t.clone()
            work = self._native_all_reduce(out, self.group, self.size, async_op=True)
            return Handle(self.stats, work=work, result=out)
        if self._pool is None:  # composite patterns run on one helper thread, in order
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp-comm")
        self.stats.launched_async()
        return Handle(self.stats, future=self._pool.submit(self._all_reduce_now, t))

    def all_gather(self, t: torch.Tensor, dim: int, sizes: Sequence[int] | None = None,
                   *, async_op: bool = False) -> Handle:
        if self.size == 1:
            return Handle(self.stats, result=t)
        return self._gather_padded(t, dim, sizes, async_op=async_op and self.async_op)

    def reduce_scatter(self, t: torch.Tensor, dim: int, sizes: Sequence[int] | None = None,
                       *, async_op: bool = False) -> Handle:
        if self.size == 1:
            return Handle(self.stats, result=t)
        return self._reduce_scatter_padded(t, dim, sizes, async_op=async_op and self.async_op)

    def broadcast_(self, t: torch.Tensor, src_index: int = 0) -> torch.Tensor:
        """In-place broadcast from the member at group index ``src_index``."""
        if self.size > 1:
            self._timed("broadcast", (self.size - 1) / self.size * _nbytes(t),
                        lambda: dist.broadcast(t, src=self.ranks[src_index], group=self.group),
                        _nbytes(t) if self.rank == src_index else 0)
        return t

    def all_reduce_coalesced_(self, tensors: Sequence[torch.Tensor], *, average: bool = False) -> int:
        """Sum (or average) ``tensors`` in place over the group with native all-reduces.

        Tensors smaller than ``fusion_threshold_bytes`` are packed into flat buffers of at
        most that size (one collective per buffer); larger ones go alone. With
        ``async_op`` all buckets are in flight at once. Returns the number of collectives.
        """
        if self.size == 1 or not tensors:
            return 0
        thr = self.fusion_threshold_bytes
        buckets: list[list[torch.Tensor]] = []
        cur: list[torch.Tensor] = []
        cur_bytes = 0
        for t in tensors:
            b = _nbytes(t)
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
            flat = (bucket[0].reshape(-1).clone() if len(bucket) == 1
                    else torch.cat([t.reshape(-1) for t in bucket]))
            work = self._native_all_reduce(flat, self.group, self.size, async_op=self.async_op)
            pending.append((bucket, flat, work))
        t0 = time.perf_counter()
        for bucket, flat, work in pending:
            if self.async_op:
                work.wait()
            if average:
                flat.div_(self.size)
            off = 0
            for t in bucket:
                t.copy_(flat[off: off + t.numel()].view_as(t))
                off += t.numel()
        if self.async_op:
            self.stats.add_comm_time(time.perf_counter() - t0)
        return len(buckets)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _ceil_sizes(n: int, p: int) -> list[int]:
    per = -(-n // p) if n else 0
    return [max(0, min(per, n - i * per)) for i in range(p)]


@dataclass
class TPGroups:
    """The TP comm of this rank, and its DP comm (``None`` when there is one replica)."""

    tp: TPComm
    dp: TPComm | None
    tp_size: int
    dp_size: int
    tp_index: int  # which TP group (= DP rank)


def build_tp_groups(tp_size: int, *, pattern: str = "AllReduce", async_op: bool = True,
                    fusion_threshold_bytes: int = 0, stats: CommStats | None = None) -> TPGroups:
    """Create the TP (and DP, hierarchical) sub-groups. Collective: every rank calls it.

    Without an initialised process group this returns single-process comms.
    """
    stats = stats if stats is not None else CommStats()
    if not dist.is_available() or not dist.is_initialized():
        if tp_size != 1:
            raise ValueError(f"tensor_parallel_size {tp_size} needs an initialised process group "
                             "(world size 1 here)")
        return TPGroups(TPComm(None, [0], rank=0, pattern=pattern, async_op=async_op,
                               fusion_threshold_bytes=fusion_threshold_bytes, stats=stats),
                        None, 1, 1, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or tp_size > world or world % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must be >= 1, at most the world size "
                         f"({world}) and divide it")
    dp_size = world // tp_size
    my_tp: tuple[Any, list[int]] | None = None
    my_hier: _Hier | None = None
    world_nodes: list[list[int]] = []
    labels: list[str] = []
    if pattern == "Hierarchical":
        from .groups import hierarchy_from_hosts, host_labels

        labels = host_labels()  # collective: every rank's host (and torchrun node)
        world_nodes = hierarchy_from_hosts(labels)
    for g in range(dp_size):
        ranks = list(range(g * tp_size, (g + 1) * tp_size))
        grp = dist.new_group(ranks) if tp_size < world else dist.group.WORLD
        if rank in ranks:
            my_tp = (grp, ranks)
        if pattern == "Hierarchical":
            from .groups import describe_hierarchy

            nodes = [[r for r in n if r in ranks] for n in world_nodes]
            nodes = [n for n in nodes if n]
            layout = describe_hierarchy(nodes, [labels[r] for r in ranks])
            leaders = [n[0] for n in nodes]
            node_groups = [dist.new_group(n) if len(n) > 1 else None for n in nodes]
            lead_group = dist.new_group(leaders) if len(leaders) > 1 else None
            for n, ng in zip(nodes, node_groups, strict=True):
                if rank in n:
                    my_hier = _Hier(ng, n, lead_group if rank == n[0] else None, n[0], layout)
    assert my_tp is not None
    tp = TPComm(my_tp[0], my_tp[1], rank=rank, pattern=pattern, async_op=async_op,
                fusion_threshold_bytes=fusion_threshold_bytes, stats=stats, hier=my_hier)
    dp: TPComm | None = None
    for j in range(tp_size):
        ranks = list(range(j, world, tp_size))
        grp = dist.new_group(ranks) if dp_size > 1 and dp_size < world else dist.group.WORLD
        if rank in ranks and dp_size > 1:
            dp = TPComm(grp, ranks, rank=rank, pattern="AllReduce", async_op=async_op,
                        fusion_threshold_bytes=fusion_threshold_bytes, stats=stats)
    return TPGroups(tp, dp, tp_size, dp_size, rank // tp_size)


# -- autograd region operators -------------------------------------------------------------


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Reductions run in fp32: half-precision partial sums are upcast before they travel."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t



class _CopyToRegion(Function):
    """f: identity forward, sum-all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.comm.all_reduce(_fp32(g.contiguous())), None


class _ReduceFromRegion(Function):
    """g: sum-all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        return comm.all_reduce(_fp32(x.contiguous()))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g, None


class _GatherFromRegion(Function):
    """All-gather along ``dim`` forward; keep this rank's slice of the gradient backward
    (the consumer is replicated, so every rank holds the same full gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return comm.all_gather(x, dim, sizes).wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        r = ctx.comm.rank
        start = sum(ctx.sizes[:r])
        return g.narrow(ctx.dim, start, ctx.sizes[r]).contiguous(), None, None, None


class _ScatterToRegion(Function):
    """Keep this rank's slice forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        r = comm.rank
        return x.narrow(dim, sum(sizes[:r]), sizes[r]).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.comm.all_gather(g.contiguous(), ctx.dim, ctx.sizes).wait(), None, None, None


class _SeqGather(Function):
    """Sequence parallel f: all-gather along the sequence dim forward, reduce-scatter back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return comm.all_gather(x.contiguous(), dim, sizes).wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.comm.reduce_scatter(_fp32(g.contiguous()), ctx.dim, ctx.sizes).wait(), None, None, None


class _SeqReduceScatter(Function):
    """Sequence parallel g: reduce-scatter along the sequence dim forward, all-gather back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return comm.reduce_scatter(_fp32(x.contiguous()), dim, sizes).wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.comm.all_gather(g.contiguous(), ctx.dim, ctx.sizes).wait(), None, None, None


class _FusedCopy(Function):
    """n consumers of one replicated input share one f: the n partial input gradients are
    summed locally and reduced with ONE collective instead of n."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, n: int) -> tuple[torch.Tensor, ...]:
        ctx.comm = comm
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        gs = [g for g in grads if g is not None]
        total = _fp32(gs[0]).clone()
        for g in gs[1:]:
            total.add_(g)
        return ctx.comm.all_reduce(total), None, None


class _FusedSeqGather(Function):
    """One sequence all-gather feeding n consumers; one reduce-scatter of their summed grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int],
                n: int) -> tuple[torch.Tensor, ...]:
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        full = comm.all_gather(x.contiguous(), dim, sizes).wait()
        return tuple(full.view_as(full) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        gs = [g for g in grads if g is not None]
        total = _fp32(gs[0]).clone()
        for g in gs[1:]:
            total.add_(g)
        return ctx.comm.reduce_scatter(total, ctx.dim, ctx.sizes).wait(), None, None, None, None


def copy_to_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)


def gather_from_region(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _GatherFromRegion.apply(x, comm, dim, sizes)


def scatter_to_region(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _ScatterToRegion.apply(x, comm, dim, sizes)


def seq_gather(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _SeqGather.apply(x, comm, dim, sizes)


def seq_reduce_scatter(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _SeqReduceScatter.apply(x, comm, dim, sizes)


def fused_copy_to_region(x: torch.Tensor, comm: TPComm, n: int) -> tuple[torch.Tensor, ...]:
    if comm.size == 1:
        return tuple(x for _ in range(n))
    return tuple(_FusedCopy.apply(x, comm, n))


def fused_seq_gather(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int],
                     n: int) -> tuple[torch.Tensor, ...]:
    if comm.size == 1:
        return tuple(x for _ in range(n))
    return tuple(_FusedSeqGather.apply(x, comm, dim, sizes, n))


# -- linear layers as single autograd functions (for compute/comm overlap) ----------------


def _mm(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype | None) -> torch.Tensor:
    """``a @ b``; with a compute dtype the product runs in it and comes back as fp32, so
    every reduction and every saved gradient stays fp32 (mixed precision)."""
    if cdt is None:
        return a @ b
    return (a.to(cdt) @ b.to(cdt)).float()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., k] -> [N, k], also when k == 0 (a rank whose shard is empty)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _wgrad(g: torch.Tensor, x: torch.Tensor, cdt: torch.dtype | None) -> torch.Tensor:
    g2, x2 = _rows(g), _rows(x)
    return _mm(g2.t(), x2, cdt)


class _ColumnLinear(Function):
    """Y_i = f(X) W_i^T + b_i, W_i the rank's block of output rows.

    ``mode``: "copy" = Megatron f (input replicated; dX = sum_i dY_i W_i all-reduced in
    backward, started asynchronously and overlapped with dW_i = dY_i^T X when async);
    "seq" = X sequence-sharded: all-gathered forward; only the shard is kept for backward
    (Korthikanti et al. 2022, §4.2.2), re-gathered there while dX_i = dY_i W_i is computed,
    then dX reduce-scattered while dW_i is computed; "none" = the input's collective is
    done outside (fused region).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm,
                mode: str, dim: int, sizes: list[int] | None, cdt: torch.dtype | None) -> torch.Tensor:
        saved = x
        if mode == "seq":
            x = comm.all_gather(x.contiguous(), dim, sizes).wait()
        t0 = time.perf_counter()
        y = _mm(x, w.t(), cdt)
        if b is not None:
            y = y + b
        comm.stats.add_compute_time(time.perf_counter() - t0)
        ctx.save_for_backward(saved, w)
        ctx.comm, ctx.mode, ctx.dim, ctx.sizes, ctx.cdt = comm, mode, dim, sizes, cdt
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        comm: TPComm = ctx.comm
        gy = gy.contiguous()
        seq = ctx.mode == "seq"
        gather: Handle | None = None
        if seq and ctx.needs_input_grad[1]:
            gather = comm.all_gather(x.contiguous(), ctx.dim, ctx.sizes, async_op=True)
        handle: Handle | None = None
        t0 = time.perf_counter()
        gx = _fp32(_mm(gy, w, ctx.cdt)) if ctx.needs_input_grad[0] else None
        t1 = time.perf_counter()
        if gather is not None:
            x = gather.wait()
        if gx is not None:
            if ctx.mode == "copy":
                handle = comm.all_reduce_async(gx)
            elif seq:
                handle = comm.reduce_scatter(gx, ctx.dim, ctx.sizes, async_op=True)
            else:
                handle = Handle(comm.stats, result=gx)
        t2 = time.perf_counter()
        gw = _wgrad(gy, x, ctx.cdt) if ctx.needs_input_grad[1] else None
        gb = _rows(gy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        t3 = time.perf_counter()
        gx_out = handle.wait() if handle is not None else None
        comm.stats.add_compute_time((t1 - t0) + (t3 - t2))
        return gx_out, gw, gb, None, None, None, None, None


class _RowLinear(Function):
    """Z = g(sum_i X_i W_i^T) + b, X_i the rank's slice of input features.

    ``mode``: "reduce" = Megatron g (all-reduce of the partial sums forward, identity back);
    "seq" = reduce-scatter along the sequence dim forward (bias added to the shard),
    all-gather of the gradient backward.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm,
                mode: str, dim: int, sizes: list[int] | None, cdt: torch.dtype | None) -> torch.Tensor:
        t0 = time.perf_counter()
        partial = _fp32(_mm(x, w.t(), cdt))
        comm.stats.add_compute_time(time.perf_counter() - t0)
        if mode == "seq":
            z = comm.reduce_scatter(partial, dim, sizes).wait()
        else:
            z = comm.all_reduce(partial)
        if b is not None:
            z = z + b
        ctx.save_for_backward(x, w)
        ctx.comm, ctx.mode, ctx.dim, ctx.sizes, ctx.cdt = comm, mode, dim, sizes, cdt
        ctx.has_bias = b is not None
        return z

    @staticmethod
    def backward(ctx: Any, gz: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        comm: TPComm = ctx.comm
        gz = gz.contiguous()
        gb = _rows(gz).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.mode == "seq":
            gz = comm.all_gather(gz, ctx.dim, ctx.sizes).wait()
        t0 = time.perf_counter()
        gx = _mm(gz, w, ctx.cdt) if ctx.needs_input_grad[0] else None
        gw = _wgrad(gz, x, ctx.cdt) if ctx.needs_input_grad[1] else None
        comm.stats.add_compute_time(time.perf_counter() - t0)
        return gx, gw, gb, None, None, None, None, None


def column_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm, *,
                  mode: str = "copy", dim: int = 0, sizes: list[int] | None = None,
                  compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    if comm.size == 1:
        mode = "none"
    return _ColumnLinear.apply(x, w, b, comm, mode, dim, sizes, compute_dtype)


def row_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm, *,
               mode: str = "reduce", dim: int = 0, sizes: list[int] | None = None,
               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _RowLinear.apply(x, w, b, comm, mode, dim, sizes, compute_dtype)


# -- small world-level helpers for the tensor-parallel executor ----------------------------


def world_barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def world_mean(values: Sequence[float], device: torch.device | None = None) -> list[float]:
    """Mean of ``values`` over all ranks (float64); identity in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def broadcast_int(value: int | None, src: int = 0, device: torch.device | None = None) -> int | None:
    """Rank ``src``'s integer (``None`` travels as -1) on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([-1 if value is None else value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=src)
    v = int(t.item())
    return None if v < 0 else v


def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's copy of ``module`` equal to rank ``src``'s (in place), so that the
    shards cut from it fit together whatever randomness a model factory used."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.state_dict().values()):
            dist.broadcast(t, src=src)
