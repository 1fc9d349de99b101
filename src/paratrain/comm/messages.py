"""Point-to-point messages on torch.distributed: tensors of a known shape, byte strings
with or without a length header, one tensor to many ranks, a sum of tensors from many ranks,
and a pairwise byte exchange among peers. Lengths are checked against a limit before anything
is allocated; nothing is unpickled. Ranks are ranks of the group passed (``None``: the default
group). The pipeline's activation transport is :mod:`paratrain.comm.p2p`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommCounter, comm_device, count_op, global_rank, nbytes_of


def send_tensor(t: torch.Tensor, *, dst: int, group: Any = None, counter: CommCounter | None = None) -> None:
    """Blocking send of a contiguous tensor whose shape and dtype the receiver knows."""
    t = t.contiguous()
    count_op(counter, "send", nbytes_of(t))
    dist.send(t, dst=dst, group=group)


def recv_tensor(shape: Sequence[int], *, dtype: torch.dtype, src: int, group: Any = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Blocking receive of a new tensor of ``shape``/``dtype``."""
    buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(buf, src=src, group=group)
    return buf


def send_bytes(data: bytes | torch.Tensor, *, dst: int, group: Any = None,
               counter: CommCounter | None = None, header: bool = True) -> None:
    """Send a byte string (``bytes`` or a tensor's raw bytes) to ``dst``: an int64 length
    header, then the uint8 payload; ``header=False`` the payload alone, for a receiver that
    learnt the length another way (``recv_bytes(nbytes=...)``). Empty: the header only."""
    dev = comm_device(group)
    if isinstance(data, bytes | bytearray):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    payload = data.reshape(-1).view(torch.uint8).to(dev)
    if header:
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), dst=dst, group=group)
    if payload.numel():
        dist.send(payload.contiguous(), dst=dst, group=group)
    if header or payload.numel():
        count_op(counter, "send", (8 if header else 0) + payload.numel())


def recv_bytes(*, src: int, group: Any = None, max_bytes: int = 1 << 32, nbytes: int | None = None,
               counter: CommCounter | None = None) -> bytes:
    """Receive what :func:`send_bytes` sent (``nbytes``: sent with ``header=False``); a length
    above ``max_bytes`` is an error. ``counter`` books the bytes under ``recv``."""
    dev = comm_device(group)
    if nbytes is None:
        head = torch.empty(1, dtype=torch.int64, device=dev)
        dist.recv(head, src=src, group=group)
        nbytes = int(head.item())
    if not 0 <= nbytes <= max_bytes:
        raise ValueError(f"recv_bytes: peer {src} announced {nbytes} bytes (limit {max_bytes})")
    if nbytes == 0:
        return b""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dist.recv(buf, src=src, group=group)
    count_op(counter, "recv", nbytes)
    return bytes(buf.cpu().numpy().tobytes())


def send_to_many(t: torch.Tensor, *, dsts: Iterable[int], group: Any = None,
                 counter: CommCounter | None = None) -> None:
    """Send ``t`` to every rank of ``group`` in ``dsts`` at once (asynchronous sends, then wait)."""
    t = t.contiguous()
    works = [(d, dist.isend(t, dst=global_rank(group, d), group=group)) for d in dsts]
    for _, w in works:
        if w is not None:
            w.wait()
    count_op(counter, "send", len(works) * nbytes_of(t))


def recv_sum_(total: torch.Tensor, *, srcs: Iterable[int], group: Any = None) -> int:
    """``total += t_s`` for a tensor of ``total``'s shape from each rank ``s`` in ``srcs``, posted
    at once and added in ``srcs`` order (whatever order they arrive in); returns the bytes."""
    bufs = [(s, torch.empty_like(total)) for s in srcs]
    works = [dist.irecv(b, src=global_rank(group, s), group=group) for s, b in bufs]
    for w, (_, b) in zip(works, bufs, strict=True):
        if w is not None:
            w.wait()
        total.add_(b)
    return len(bufs) * nbytes_of(total)


def batch_exchange(sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], *,
                   group: Any = None) -> None:
    """Send ``sends[j]`` to and receive ``recvs[j]`` from rank ``j`` of ``group``, all in one
    batch of point-to-point operations (an empty tensor stays home), and wait for them."""
    ops = [dist.P2POp(dist.isend, t, global_rank(group, j), group=group) for j, t in sends.items()
           if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, j), group=group) for j, t in recvs.items()
            if t.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def exchange_bytes(payload: torch.Tensor, *, peers: Sequence[int], group: Any = None,
                   max_bytes: int = 1 << 32) -> dict[int, bytes]:
    """Send the uint8 ``payload`` to every rank in ``peers`` (each calls it with this rank among
    its own) and receive theirs: the int64 lengths first, checked against ``max_bytes``, then
    the payloads, each round one :func:`batch_exchange`."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise TypeError("exchange_bytes expects a 1-d uint8 tensor")
    if not peers:
        return {}
    dev = comm_device(group)
    wire = payload.to(dev)
    length = torch.tensor([wire.numel()], dtype=torch.int64, device=dev)
    lens = {j: torch.empty(1, dtype=torch.int64, device=dev) for j in peers}
    batch_exchange(dict.fromkeys(peers, length), lens, group=group)
    bufs = {}
    for j in peers:
        k = int(lens[j].item())
        if not 0 <= k <= max_bytes:
            raise ValueError(f"exchange_bytes: peer {j} announced {k} bytes (limit {max_bytes})")
        bufs[j] = torch.empty(k, dtype=torch.uint8, device=dev)
    batch_exchange(dict.fromkeys(peers, wire), bufs, group=group)
    return {j: bytes(b.cpu().numpy().tobytes()) for j, b in bufs.items()}


class PendingSends:
    """:func:`send_bytes` without waiting: each message's header and payload posted as
    asynchronous sends, kept (with their tensors) until :meth:`wait`. A sender that must not
    block on a busy receiver (a server handing work to its workers) posts and moves on."""

    def __init__(self, group: Any = None, counter: CommCounter | None = None) -> None:
        self.group, self.counter = group, counter
        self.works: list[tuple[Any, torch.Tensor]] = []

    def post(self, data: bytes, *, dst: int) -> None:
        dev = comm_device(self.group)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if data else None
        head = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        peer = global_rank(self.group, dst)
        for t in (head, payload):
            if t is not None:
                self.works.append((dist.isend(t, dst=peer, group=self.group), t))
        count_op(self.counter, "send", 8 + len(data))
        self.works = [(w, t) for w, t in self.works if w is not None and not w.is_completed()]

    def wait(self) -> None:
        for w, _ in self.works:
            w.wait()
        self.works = []


class AnySource:
    """Receive what :func:`send_bytes` (header on) sent, from whichever rank of ``group`` sends
    first, in the order they come: a thread posts one receive from any source for each message
    announced by :meth:`expect` (gloo's receive makes progress only inside ``wait``, so a poll
    would never see one), then takes the payload from that sender (a rank sends its header
    before its payload, so they cannot mix). The thread is the group's only receiver meanwhile."""

    def __init__(self, group: Any = None, *, max_bytes: int = 1 << 32, counter: CommCounter | None = None) -> None:
        self.group, self.max_bytes, self.counter = group, max_bytes, counter
        self.got: queue.Queue[tuple[int, bytes] | BaseException] = queue.Queue()
        self.expected, self.closed = 0, False
        self.cv = threading.Condition()
        self.thread: threading.Thread | None = None

    def expect(self, n: int = 1) -> None:
        """``n`` more messages will come."""
        with self.cv:
            self.expected += n
            self.cv.notify()
        if self.thread is None:
            self.thread = threading.Thread(target=self._receive, name="paratrain-any-source", daemon=True)
            self.thread.start()

    def _receive(self) -> None:
        head = torch.empty(1, dtype=torch.int64, device=comm_device(self.group))
        while True:
            with self.cv:
                while not self.expected and not self.closed:
                    self.cv.wait()
                if not self.expected:
                    return
                self.expected -= 1
            try:
                work = dist.irecv(head, src=None, group=self.group)
                assert work is not None  # (this rank is in the group)
                work.wait()
                src = int(work._source_rank())
                self.got.put((src, recv_bytes(src=global_rank(self.group, src), group=self.group,
                                              nbytes=int(head.item()), max_bytes=self.max_bytes,
                                              counter=self.counter)))
            except BaseException as e:  # noqa: BLE001 - handed to the taker, who raises it
                self.got.put(e)
                return

    def take(self, *, block: bool) -> tuple[int, bytes] | None:
        """``(sender's group rank, bytes)``; None when ``block`` is off and nothing has come."""
        try:
            item = self.got.get(block=block)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (after the messages expected have come)."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join()
