"""All-reduce through shared memory among a group's processes on one host: :class:`HostArena`.

Gloo moves every byte over TCP, loopback included: on a 2-core host an all-reduce of 8 MB
between 2 processes takes about 7 ms, against about 1.5 ms to copy the buffer once
(benchmarks/data_parallel.py, ``busbw_ratio_vs_memcpy``). The processes of one host can read
each other's buffers instead, as DeepSpeed's, vLLM's and SGLang's CPU all-reduces do (and
gloo's RFC pytorch/gloo#455, not in the gloo that torch 2.13 ships). The group maps one file
of ``/dev/shm``, unlinked as soon as every rank has mapped it; rank ``r`` keeps its own
gradient buckets in its slot there (:class:`~.buckets.GradReducer` writes them straight in),
and a reduction of a bucket of ``n`` ranks' slots ``s_k`` is, with chunk ``c_r`` of it owned
by rank ``r``:

1. barrier (every rank's bucket is written);
2. rank ``r``: ``t = s_0[c_r] + s_1[c_r] + ... + s_{n-1}[c_r]`` (in rank order; on 2 ranks
   bit for bit gloo's ``a + b``), then ``s_k[c_r] <- t`` for every ``k``: only rank ``r``
   touches chunk ``c_r``, so the ranks never read what another is writing;
3. barrier (every slot holds every sum: a rank may write its slot again, at its next step).

Each rank reads the bucket once and writes it once, where TCP copies it into and out of the
kernel per hop. The barriers are one-element all-reduces on a gloo backend of the same
ranks made for the arena alone (:func:`private_gloo`: they never interleave with the
collectives of the thread that runs the model, and no other group shares its name), issued
by one worker thread in launch order; every rank launches the same buckets in the same order
(:class:`~.buckets.GradReducer` launches in index order). Made only when every rank of the
group maps the same file (one host, or hosts sharing ``/dev/shm``) and the file's pages are
reserved (``posix_fallocate``: a full ``/dev/shm`` is a fallback to gloo, never a SIGBUS);
``PARATRAIN_SHM=0`` keeps gloo. Any group can have one: the default group or a subgroup (a
tensor-parallel mesh's data-parallel columns, a pipeline stage's replicas). :class:`SyncArena`
is the same idea for collectives made one at a time on the caller's thread (ZeRO's flat
all-gather and reduce-scatter). tests/comm/test_comm_shm.py holds both to gloo's collectives.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
import uuid
from typing import Any

import torch
import torch.distributed as dist

from .collectives import global_rank, rank_of, world_size

SHM_DIR = "/dev/shm"
# Below this a bucket goes through gloo: a reduction here costs two barriers (one-element
# all-reduces, about 0.25 ms each on an idle 2-core host), which one gloo all-reduce of a small
# bucket beats (2 ranks, 80 repeats: 256 KiB gloo 0.61 ms, here 0.77; 512 KiB gloo 2.1, here 0.80).
MIN_BYTES = 256 * 1024
_ALIGN = 64  # bytes: every region starts on a cache line


def enabled() -> bool:
    """Whether shared-memory reductions may be used (``PARATRAIN_SHM=0`` says no)."""
    return os.environ.get("PARATRAIN_SHM", "1") != "0" and os.path.isdir(SHM_DIR)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out <- parts[0] + parts[1] + ...`` in rank order (on 2 ranks gloo's ``a + b`` bit for
    bit); ``out`` may be one of the parts."""
    if len(parts) == 2:  # element-wise, so writing over one of the terms is safe
        torch.add(parts[0], parts[1], out=out)
        return
    total = torch.add(parts[0], parts[1])
    for part in parts[2:]:
        total.add_(part)
    out.copy_(total)


def open_existing(path: str) -> int:
    """Open the file another rank made (fails where that rank is on another host)."""
    return os.open(path, os.O_RDWR)


def _map_file(nbytes: int, group: Any, wanted: bool) -> tuple[mmap.mmap, str] | None:
    """One ``/dev/shm`` file of ``nbytes`` mapped by every rank of ``group`` (collective) and
    its path, or None on every rank when any rank could not map it or did not want to
    (``wanted``: its own environment's say). The file is unlinked before this returns."""
    rank = rank_of(group)
    path: str | None = None
    fd = -1
    if rank == 0 and wanted:
        path = os.path.join(SHM_DIR, f"paratrain-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.posix_fallocate(fd, 0, nbytes)  # reserve the pages now: no SIGBUS later
        except OSError:
            if fd >= 0:
                os.close(fd)
                fd = -1
            with contextlib.suppress(OSError):
                os.unlink(path)
            path = None
    box: list[Any] = [path]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    mm: mmap.mmap | None = None
    if box[0] is not None and wanted:
        try:
            if rank != 0:
                fd = open_existing(box[0])
            if os.fstat(fd).st_size == nbytes:
                mm = mmap.mmap(fd, nbytes)
        except OSError:
            mm = None
        finally:
            if fd >= 0:
                os.close(fd)
    ok = torch.tensor([1 if mm is not None else 0], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has opened it by now
    if rank == 0 and path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if int(ok.item()) == 1 and mm is not None:
        return mm, str(box[0])
    if mm is not None:
        mm.close()
    return None


def _registered(group: Any) -> bool:
    """Whether ``group`` is one of torch.distributed's own (a process group object of another
    kind, e.g. a fault-tolerant replica group's, keeps its own collectives)."""
    return group is None or group in dist.distributed_c10d._world.pg_map


_PRIVATE: dict[tuple[int, ...], int] = {}  # rank set -> how many backends this process made for it


def private_gloo(group: Any) -> Any:
    """A gloo backend of ``group``'s ranks that no other group shares, for an arena's worker
    thread: named in torch's default store by the ranks and by how many this process has made
    for them (every member makes its arenas in the same order, as it makes its reducers). A
    torch group cannot serve a subgroup here: one made by its members alone is named by a
    hash of its ranks, which a second one of the same ranks (a checkpoint writer's side
    group) would share, mixing their messages. It is not registered with torch.distributed:
    its ``allreduce`` is called directly."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    made = _PRIVATE.get(ranks, 0)
    _PRIVATE[ranks] = made + 1
    store = dist.PrefixStore(f"paratrain-shm/{'-'.join(map(str, ranks))}/{made}/",  # type: ignore[attr-defined]
                             dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, rank_of(group), len(ranks), dist.distributed_c10d.default_pg_timeout)


class _Work:
    """A launched reduction: :meth:`wait` returns once it is done (re-raising its error)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"shared-memory all-reduce failed: {self.error}") from self.error


class HostArena:
    """Buckets in shared memory and their reductions (module doc). :meth:`create` is
    collective over ``group``; :meth:`slot` is this rank's view of a bucket (written by the
    caller), :meth:`all_reduce` sums a bucket over the ranks in place, on the worker thread."""

    def __init__(self, mm: mmap.mmap, path: str, group: Any, layout: list[tuple[int, int, torch.dtype]]) -> None:
        self.group, self.n, self.rank = group, world_size(group), rank_of(group)
        self.path = path  # unlinked: its name only
        self._side = private_gloo(group)
        raw = memoryview(mm)
        # bucket b, rank k: bytes [offset_b + k * stride_b, + numel_b * itemsize_b), a storage of
        # its own, so that a rank's tensors account for its slots only, not the whole mapping
        self._slots: list[list[torch.Tensor]] = []
        offset = 0
        for numel, itemsize, dtype in layout:
            stride = _aligned(numel * itemsize)
            self._slots.append([torch.frombuffer(raw[offset + k * stride: offset + k * stride + numel * itemsize],
                                                 dtype=dtype) for k in range(self.n)])
            offset += self.n * stride
        self._flag = torch.zeros(1)
        self._queue: queue.SimpleQueue[tuple[int, _Work] | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="paratrain-shm-allreduce", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, buckets: list[tuple[int, torch.dtype]], group: Any) -> HostArena | None:
        """An arena for buckets of ``(numel, dtype)`` on every rank of ``group``, or None
        (one rank, not enabled, or some rank cannot map the file): collective."""
        n = world_size(group)
        if n < 2 or not buckets or not _registered(group):
            return None
        layout = [(numel, torch.empty(0, dtype=dtype).element_size(), dtype) for numel, dtype in buckets]
        nbytes = sum(n * _aligned(numel * size) for numel, size, _ in layout)
        mapped = _map_file(nbytes, group, enabled())  # collective even where one rank says no
        return None if mapped is None else cls(*mapped, group, layout)

    def slot(self, b: int) -> torch.Tensor:
        """This rank's bucket ``b`` (flat; zero at first)."""
        return self._slots[b][self.rank]

    def all_reduce(self, b: int) -> _Work:
        """Start summing bucket ``b`` over the ranks into every rank's slot."""
        work = _Work()
        self._queue.put((b, work))
        return work

    def _barrier(self) -> None:
        self._side.allreduce([self._flag]).wait()

    def _reduce(self, b: int) -> None:
        slots, n, r = self._slots[b], self.n, self.rank
        size = slots[0].numel()
        chunk = -(-size // n)
        lo, hi = min(r * chunk, size), min((r + 1) * chunk, size)
        self._barrier()
        if hi > lo:
            mine = slots[r][lo:hi]
            sum_in_rank_order([s[lo:hi] for s in slots], mine)
            for k in range(n):
                if k != r:
                    slots[k][lo:hi].copy_(mine)
        self._barrier()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            b, work = item
            if self._failed is None:
                try:
                    self._reduce(b)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    self._failed = e
            work.error = self._failed
            work.done.set()

    def close(self) -> None:
        """Stop the worker thread (the mapping lives as long as the tensors viewing it)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()



class SyncArena:
    """One slot of shared memory per rank of a group for collectives made on the
    caller's thread, one at a time (ZeRO's flat all-gather and reduce-scatter,
    :class:`~.zero.FlatShard`): each rank writes its slot, a barrier, each reads what it
    needs of every slot, a barrier (so that no rank writes its slot again while another still
    reads it). The barriers are one-element all-reduces on the group itself, made in program
    order with its other collectives. :func:`sync_arena` makes and grows it."""

    def __init__(self, mm: mmap.mmap, group: Any, capacity: int) -> None:
        self.group, self.n, self.rank, self.capacity = group, world_size(group), rank_of(group), capacity
        raw = memoryview(mm)
        self._slots = [torch.frombuffer(raw[k * capacity:(k + 1) * capacity], dtype=torch.uint8)
                       for k in range(self.n)]
        self._flag = torch.zeros(1)

    def slots(self, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot, its first ``numel`` elements as ``dtype`` (rank order)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return [s[: numel * size].view(dtype) for s in self._slots]

    def barrier(self) -> None:
        dist.all_reduce(self._flag, group=self.group)


_SYNC: dict[int, tuple[Any, SyncArena | None]] = {}


def sync_arena(group: Any, nbytes: int) -> SyncArena | None:
    """``group``'s :class:`SyncArena` holding ``nbytes`` a slot, or None (one rank, under
    :data:`MIN_BYTES`, not enabled or not mappable on some rank: gloo). Collective when it
    makes or grows the arena: every rank calls it at the same collective with the same
    ``nbytes``, so every rank decides alike."""
    n = world_size(group)
    if n < 2 or nbytes <= MIN_BYTES or not _registered(group):
        return None
    owner = group if group is not None else dist.group.WORLD
    key = id(owner)
    held = _SYNC.get(key)
    if held is not None and held[0] is owner:
        arena = held[1]
        if arena is None or arena.capacity >= nbytes:
            return arena
        capacity = max(_aligned(nbytes), 2 * arena.capacity)
    else:
        capacity = _aligned(nbytes)
    mapped = _map_file(n * capacity, group, enabled())
    made = None if mapped is None else SyncArena(mapped[0], group, capacity)
    _SYNC[key] = (owner, made)  # the group kept, so that its id is not another's
    return made
