"""Collectives on torch.distributed: bucketed all-reduce, variable-size all-gather,
point-to-point byte messages, and fallbacks for ops a backend lacks.

Bucketed all-reduce (the DDP reducer's idea, Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB): the gradients are grouped in
order into buckets of at most ``bucket_bytes`` (same dtype and device), each bucket is
flattened into one contiguous buffer, all-reduced once (SUM), scaled by ``1/world``
and copied back. A tensor larger than the bucket gets a bucket of its own. Fewer, larger
messages amortise the per-collective latency; the result is the element-wise mean

    g_i  <-  (1/n) * sum_r g_i^(r)        for every tensor i.

Which parameters some rank used (:func:`used_mask`, DDP's ``find_unused_parameters``
rule): one small MAX all-reduce of one flag per parameter. A parameter no rank produced
a gradient for keeps ``grad = None`` (the optimizer skips it: no momentum, no weight
decay); one that some rank used is averaged, ranks that did not use it adding zeros.

Variable-size all-gather: sizes first (one int64 all-gather), then payloads padded to
the largest size, trimmed on arrival; used for compressed (sparse) gradients whose byte
length differs between ranks.

Fallbacks: ``reduce_scatter`` = all-reduce of the concatenation, keep own chunk (also
handles uneven chunks); ``all_gather_into_tensor`` = list all-gather + concatenation.
They are used when the backend raises for the native op, or when ``fallback=True``.

Every function takes the process group explicitly (``None`` = the default group) and
records what it moved in an optional :class:`CommCounter`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CommCounter",
    "DEFAULT_BUCKET_MB",
    "make_buckets",
    "all_reduce_mean",
    "all_reduce_buckets",
    "all_gather_variable",
    "all_min_ints",
    "all_gather_text",
    "send_bytes",
    "recv_bytes",
    "send_tensor",
    "recv_tensor",
    "send_to_many",
    "recv_sum_",
    "exchange_bytes",
    "rank_of",
    "barrier",
    "broadcast_",
    "all_reduce_",
    "used_mask",
    "start_used_mask",
    "reduce_scatter",
    "all_gather_into_tensor",
    "broadcast_tensors",
    "world_size",
    "bucket_bytes_of",
    "consensus_distance",
    "GradReducer",
    "comm_device",
]

DEFAULT_BUCKET_MB = 25.0
_UNSUPPORTED: set[tuple[str, str]] = set()  # (backend, op) seen to raise "unsupported"


@dataclass
class CommCounter:
    """Counts of collectives by name and the bytes each rank sent through them."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + int(nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "total_bytes": self.total_bytes}


def _count(counter: CommCounter | None, op: str, nbytes: int) -> None:
    if counter is not None:
        counter.add(op, nbytes)


def comm_device(group: Any = None) -> torch.device:
    """Where tensors must live to travel through ``group``: the current GPU for NCCL."""
    if dist.is_initialized() and str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank_of(group: Any = None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group`` (no-op for one process)."""
    if world_size(group) > 1:
        dist.barrier(group=group)


def broadcast_(tensor: torch.Tensor, *, src: int = 0, group: Any = None,
               counter: CommCounter | None = None) -> torch.Tensor:
    """In place: ``tensor`` becomes ``src``'s (no-op for one process); returns it."""
    if world_size(group) > 1:
        _count(counter, "broadcast", _nbytes(tensor))
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_reduce_(tensor: torch.Tensor, *, group: Any = None, op: str = "sum",
                counter: CommCounter | None = None) -> torch.Tensor:
    """In place: the element-wise ``op`` (``sum`` | ``max`` | ``min``) over the ranks."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce_: unknown op {op!r}; valid: {', '.join(ops)}")
    if world_size(group) > 1:
        _count(counter, "all_reduce", _nbytes(tensor))
        dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_min_ints(values: Sequence[int], *, group: Any = None) -> list[int]:
    """Element-wise minimum of ``values`` (int64) over the ranks of ``group``; a copy in
    one process. Negate an entry to get its maximum in the same collective."""
    if world_size(group) == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def all_gather_text(text: str, *, group: Any = None) -> list[str]:
    """Every rank's ``text`` (UTF-8), by rank; ``[text]`` in one process."""
    if world_size(group) == 1:
        return [text]
    data = text.encode("utf-8")
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
               else torch.zeros(0, dtype=torch.uint8)).to(comm_device(group))
    return [bytes(t.cpu().tolist()).decode("utf-8", errors="replace")
            for t in all_gather_variable(payload, group=group, max_numel=1 << 24)]


def start_used_mask(
    local: Sequence[bool], *, group: Any = None, counter: CommCounter | None = None,
) -> Any:
    """Launch :func:`used_mask` asynchronously; call the result to get the flags."""
    flags = torch.tensor([1 if u else 0 for u in local], dtype=torch.uint8, device=comm_device(group))
    if world_size(group) == 1 or flags.numel() == 0:
        return lambda: [bool(u) for u in local]
    _count(counter, "used_mask", _nbytes(flags))
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait() -> list[bool]:
        work.wait()
        return [bool(v) for v in flags.tolist()]

    return wait


def used_mask(local: Sequence[bool], *, group: Any = None, counter: CommCounter | None = None) -> list[bool]:
    """For each entry, whether any rank of ``group`` passed True (one uint8 MAX all-reduce)."""
    return list(start_used_mask(local, group=group, counter=counter)())


def bucket_bytes_of(bucket_size_mb: float) -> int:
    """``bucket_size_mb`` in bytes; MB means MiB, as in torch DDP's ``bucket_cap_mb``."""
    return max(1, int(bucket_size_mb * 1024 * 1024))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_buckets(
    tensors: Sequence[torch.Tensor], bucket_bytes: int, *, first_bucket_bytes: int | None = None,
) -> list[list[int]]:
    """Indices of ``tensors`` grouped in order into buckets of at most ``bucket_bytes``.

    A bucket holds one dtype and one device; a tensor bigger than ``bucket_bytes`` sits
    alone in its bucket. Every index appears exactly once, order preserved.
    ``first_bucket_bytes`` caps the first bucket separately (DDP uses 1 MiB so that the
    gradients ready first start travelling early).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (got {bucket_bytes})")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    key: tuple[torch.dtype, torch.device] | None = None
    for i, t in enumerate(tensors):
        k = (t.dtype, t.device)
        nb = _nbytes(t)
        cap = first_bucket_bytes if (first_bucket_bytes is not None and not buckets) else bucket_bytes
        if current and (k != key or size + nb > cap):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nb
        key = k
    if current:
        buckets.append(current)
    return buckets


def _flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(ts) == 1:
        return ts[0].detach().reshape(-1).clone()
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in ts:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def all_reduce_buckets(
    tensors: Sequence[torch.Tensor],
    *,
    group: Any = None,
    bucket_bytes: int = int(DEFAULT_BUCKET_MB * 1024 * 1024),
    average: bool = True,
    counter: CommCounter | None = None,
    async_op: bool = True,
) -> None:
    """In place: every tensor becomes the sum (``average=False``) or mean over ranks.

    Buckets are launched asynchronously and waited in order, so the flatten of bucket
    ``b+1`` overlaps the transfer of bucket ``b``.
    """
    n = world_size(group)
    if n == 1 or not tensors:
        return
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    for idx in make_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in idx]
        flat = _flatten(members)
        _count(counter, "all_reduce", _nbytes(flat))
        work = dist.all_reduce(flat, group=group, async_op=async_op)
        pending.append((work, flat, members))
    for work, flat, members in pending:
        if work is not None:
            work.wait()
        if average:
            flat.div_(n)
        _unflatten_into(flat, members)


def all_reduce_mean(
    tensors: Iterable[torch.Tensor],
    *,
    group: Any = None,
    bucket_size_mb: float = DEFAULT_BUCKET_MB,
    counter: CommCounter | None = None,
) -> None:
    """Element-wise mean over ranks, in place, through bucketed all-reduce."""
    all_reduce_buckets(
        list(tensors), group=group, bucket_bytes=bucket_bytes_of(bucket_size_mb),
        average=True, counter=counter,
    )


def all_gather_variable(
    payload: torch.Tensor,
    *,
    group: Any = None,
    counter: CommCounter | None = None,
    max_numel: int = 1 << 31,
) -> list[torch.Tensor]:
    """Gather a 1-D tensor whose length differs by rank; returns one tensor per rank.

    Two collectives: the lengths (int64), then the payloads padded to the longest.
    A length above ``max_numel`` is rejected before anything is allocated.
    """
    if payload.dim() != 1:
        raise ValueError(f"all_gather_variable needs a 1-D tensor (got shape {tuple(payload.shape)})")
    n = world_size(group)
    if n == 1:
        return [payload.clone()]
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    sizes = [torch.empty_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    bad = [ln for ln in lengths if not 0 <= ln <= max_numel]
    if bad:
        raise ValueError(f"all_gather_variable: peer announced {bad[0]} elements (limit {max_numel})")
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=payload.dtype, device=payload.device)
    padded[: payload.numel()] = payload
    out = [torch.empty_like(padded) for _ in range(n)]
    _count(counter, "all_gather", _nbytes(padded) + 8)
    dist.all_gather(out, padded, group=group)
    return [o[:ln] for o, ln in zip(out, lengths, strict=True)]


def send_tensor(t: torch.Tensor, *, dst: int, group: Any = None, counter: CommCounter | None = None) -> None:
    """Blocking send of a contiguous tensor whose shape and dtype the receiver knows."""
    t = t.contiguous()
    _count(counter, "send", _nbytes(t))
    dist.send(t, dst=dst, group=group)


def recv_tensor(
    shape: Sequence[int], *, dtype: torch.dtype, src: int, group: Any = None,
    device: torch.device | str = "cpu", out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocking receive into ``out`` (or a new tensor of ``shape``/``dtype``)."""
    buf = out if out is not None else torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(buf, src=src, group=group)
    return buf


def send_bytes(data: bytes | torch.Tensor, *, dst: int, group: Any = None,
               counter: CommCounter | None = None, header: bool = True) -> None:
    """Send a byte string (``bytes`` or a tensor, sent as its raw bytes) to ``dst``.

    ``header=True``: an int64 length header, then the uint8 payload (receive with
    :func:`recv_bytes`). ``header=False``: the payload alone, for a receiver that learnt
    the length another way (a control message) and passes ``recv_bytes(nbytes=...)``.
    An empty payload sends only the header (nothing at all without one).
    """
    dev = comm_device(group)
    if isinstance(data, bytes | bytearray):
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    else:
        payload = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
    payload = payload.to(dev)
    if header:
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), dst=dst, group=group)
    if payload.numel():
        dist.send(payload.contiguous(), dst=dst, group=group)
    if header or payload.numel():
        _count(counter, "send", (8 if header else 0) + payload.numel())


def recv_bytes(*, src: int, group: Any = None, max_bytes: int = 1 << 32, nbytes: int | None = None,
               counter: CommCounter | None = None) -> bytes:
    """Receive what :func:`send_bytes` sent; a length above ``max_bytes`` is an error.

    ``nbytes`` given: the sender used ``header=False`` and this many bytes follow.
    ``counter`` books them under ``recv``.
    """
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
    _count(counter, "recv", nbytes)
    return bytes(buf.cpu().numpy().tobytes())


def _peer(group: Any, j: int) -> int:
    """The global rank of ``group``'s rank ``j`` (point-to-point ops address global ranks)."""
    return dist.get_global_rank(group, j) if group is not None else j


def send_to_many(t: torch.Tensor, *, dsts: Iterable[int], group: Any = None,
                 counter: CommCounter | None = None) -> None:
    """Send ``t`` to every rank of ``group`` in ``dsts`` at once (asynchronous sends, then wait)."""
    t = t.contiguous()
    works = [(d, dist.isend(t, dst=_peer(group, d), group=group)) for d in dsts]
    for _, w in works:
        if w is not None:
            w.wait()
    _count(counter, "send", len(works) * _nbytes(t))


def recv_sum_(total: torch.Tensor, *, srcs: Iterable[int], group: Any = None) -> int:
    """``total += t_s`` for a tensor of ``total``'s shape from each rank ``s`` in ``srcs``.

    All receives are posted at once; they are added in the order of ``srcs`` (so the
    sum is the same whatever order they arrive in). Returns the bytes received.
    """
    bufs = [(s, torch.empty_like(total)) for s in srcs]
    works = [dist.irecv(b, src=_peer(group, s), group=group) for s, b in bufs]
    for w, (_, b) in zip(works, bufs, strict=True):
        if w is not None:
            w.wait()
        total.add_(b)
    return len(bufs) * _nbytes(total)


def exchange_bytes(payload: torch.Tensor, *, peers: Sequence[int], group: Any = None,
                   max_bytes: int = 1 << 32) -> dict[int, bytes]:
    """Send the uint8 ``payload`` to every rank in ``peers`` and receive theirs.

    Every peer must call it with this rank among its ``peers``. Lengths travel first
    (int64, checked against ``max_bytes`` before anything is allocated), then the
    payloads, each round as one batch of point-to-point operations.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise TypeError("exchange_bytes expects a 1-d uint8 tensor")
    if not peers:
        return {}
    dev = comm_device(group)
    wire = payload.to(dev)
    length = torch.tensor([wire.numel()], dtype=torch.int64, device=dev)
    lens = {j: torch.empty(1, dtype=torch.int64, device=dev) for j in peers}
    ops = []
    for j in peers:
        ops += [dist.P2POp(dist.isend, length, _peer(group, j), group=group),
                dist.P2POp(dist.irecv, lens[j], _peer(group, j), group=group)]
    for wk in dist.batch_isend_irecv(ops):
        wk.wait()
    bufs = {}
    for j in peers:
        k = int(lens[j].item())
        if not 0 <= k <= max_bytes:
            raise ValueError(f"exchange_bytes: peer {j} announced {k} bytes (limit {max_bytes})")
        bufs[j] = torch.empty(k, dtype=torch.uint8, device=dev)
    ops = []
    for j in peers:
        if wire.numel():
            ops.append(dist.P2POp(dist.isend, wire, _peer(group, j), group=group))
        if bufs[j].numel():
            ops.append(dist.P2POp(dist.irecv, bufs[j], _peer(group, j), group=group))
    if ops:
        for wk in dist.batch_isend_irecv(ops):
            wk.wait()
    return {j: bytes(b.cpu().numpy().tobytes()) for j, b in bufs.items()}


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001
        return "unknown"


def _native_failed(e: Exception) -> bool:
    text = str(e).lower()
    return any(s in text for s in ("not supported", "unsupported", "does not support", "not implemented"))


def reduce_scatter(
    output: torch.Tensor,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    group: Any = None,
    average: bool = False,
    fallback: bool | None = None,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """``output`` <- chunk ``rank`` of the sum (or mean) over ranks of ``inputs``.

    ``inputs`` is a flat tensor of ``world * output.numel()`` elements or a list with one
    chunk per rank (chunks may differ in size; ``output`` matches this rank's chunk).
    Fallback (gloo before it had the op, or uneven chunks): all-reduce the concatenation
    and copy out this rank's slice (bytes moved: the whole concatenation).
    """
    n = world_size(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    chunks = list(inputs) if not isinstance(inputs, torch.Tensor) else list(
        inputs.reshape(-1).split(output.numel())
    )
    if len(chunks) != n:
        raise ValueError(f"reduce_scatter: {len(chunks)} input chunks for {n} ranks")
    if chunks[rank].numel() != output.numel():
        raise ValueError(
            f"reduce_scatter: output has {output.numel()} elements, this rank's chunk {chunks[rank].numel()}"
        )
    if n == 1:
        output.copy_(chunks[0].view_as(output))
        return output
    even = all(c.numel() == output.numel() for c in chunks)
    use_fallback = fallback if fallback is not None else (
        not even or (_backend(group), "reduce_scatter") in _UNSUPPORTED
    )
    if not use_fallback:
        try:
            flat = torch.cat([c.reshape(-1) for c in chunks])
            out_flat = output.reshape(-1) if output.is_contiguous() else output.contiguous().reshape(-1)
            _count(counter, "reduce_scatter", _nbytes(flat))
            dist.reduce_scatter_tensor(out_flat, flat, group=group)
            if out_flat.data_ptr() != output.data_ptr():
                output.copy_(out_flat.view_as(output))
            if average:
                output.div_(n)
            return output
        except (RuntimeError, NotImplementedError) as e:
            if not _native_failed(e):
                raise
            _UNSUPPORTED.add((_backend(group), "reduce_scatter"))
    flat = torch.cat([c.reshape(-1) for c in chunks])
    _count(counter, "reduce_scatter_fallback", _nbytes(flat))
    dist.all_reduce(flat, group=group)
    start = sum(c.numel() for c in chunks[:rank])
    output.copy_(flat[start : start + output.numel()].view_as(output))
    if average:
        output.div_(n)
    return output


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: Any = None,
    fallback: bool | None = None,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """``output`` (``world * input.numel()`` elements) <- the ranks' inputs, concatenated."""
    n = world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather_into_tensor: output has {output.numel()} elements, need {n} x {input.numel()}"
        )
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return output
    use_fallback = fallback if fallback is not None else (_backend(group), "all_gather") in _UNSUPPORTED
    if not use_fallback:
        try:
            out_flat = output.reshape(-1) if output.is_contiguous() else output.contiguous().reshape(-1)
            _count(counter, "all_gather_into_tensor", _nbytes(input))
            dist.all_gather_into_tensor(out_flat, input.contiguous().reshape(-1), group=group)
            if out_flat.data_ptr() != output.data_ptr():
                output.copy_(out_flat.view_as(output))
            return output
        except (RuntimeError, NotImplementedError) as e:
            if not _native_failed(e):
                raise
            _UNSUPPORTED.add((_backend(group), "all_gather"))
    parts = [torch.empty_like(input.reshape(-1)) for _ in range(n)]
    _count(counter, "all_gather_fallback", _nbytes(input))
    dist.all_gather(parts, input.contiguous().reshape(-1), group=group)
    output.copy_(torch.cat(parts).view_as(output))
    return output


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], *, src: int = 0, group: Any = None,
    bucket_bytes: int = int(DEFAULT_BUCKET_MB * 1024 * 1024), counter: CommCounter | None = None,
) -> None:
    """In place: every rank's tensors become ``src``'s, bucketed like all-reduce."""
    ts = list(tensors)
    if world_size(group) == 1 or not ts:
        return
    for idx in make_buckets(ts, bucket_bytes):
        members = [ts[i] for i in idx]
        flat = _flatten(members)
        _count(counter, "broadcast", _nbytes(flat))
        dist.broadcast(flat, src=src, group=group)
        _unflatten_into(flat, members)


def consensus_distance(flat: torch.Tensor, *, group: Any = None, counter: CommCounter | None = None) -> float:
    """max_{i,j} ||x_i - x_j||_2 over ranks for this rank's flat parameter vector ``flat``.

    One all-gather of the vectors; every rank returns the same value.
    """
    n = world_size(group)
    if n == 1:
        return 0.0
    flat = flat.detach().reshape(-1)
    parts = [torch.empty_like(flat) for _ in range(n)]
    _count(counter, "all_gather", _nbytes(flat))
    dist.all_gather(parts, flat, group=group)
    stacked = torch.stack(parts).double()
    return float(torch.cdist(stacked, stacked).max())


class GradReducer:
    """Bucketed gradient all-reduce that overlaps the backward pass (as torch DDP does).

    Parameters are bucketed in *reverse* registration order (gradients become ready
    roughly from the last layer back) into buckets of at most ``bucket_bytes`` (the
    first one capped at ``first_bucket_bytes``, 1 MiB as in DDP). A
    post-accumulate-grad hook copies each gradient into its bucket's flat buffer; when a
    bucket is full its all-reduce (SUM) starts asynchronously while autograd keeps
    computing earlier layers. :meth:`finish` launches any bucket whose parameters got no
    gradient (zeros), waits, divides by the world size and writes the means back into
    ``p.grad``. Result: ``p.grad <- (1/n) sum_r p.grad^(r)``, identical to
    :func:`all_reduce_buckets`, for every parameter some rank used; a parameter no rank
    used this step gets ``p.grad = None`` (:func:`used_mask`, as DDP with
    ``find_unused_parameters=True``). ``grad_views=True`` leaves each ``p.grad`` as a view of
    its bucket (DDP's ``gradient_as_bucket_view``): zeroing gradients in place
    (``zero_grad(set_to_none=False)``) then saves both copies per step.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        group: Any = None,
        bucket_bytes: int = int(DEFAULT_BUCKET_MB * 1024 * 1024),
        first_bucket_bytes: int | None = 1024 * 1024,
        counter: CommCounter | None = None,
        grad_views: bool = False,
    ) -> None:
        self.grad_views = grad_views
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.counter = counter
        self.n = world_size(group)
        order = list(reversed(self.params))
        first = None if first_bucket_bytes is None else min(first_bucket_bytes, bucket_bytes)
        self.buckets = [
            [order[i] for i in idx]
            for idx in make_buckets(order, bucket_bytes, first_bucket_bytes=first)
        ]
        self._where: dict[int, tuple[int, int]] = {}
        self._flat: list[torch.Tensor] = []
        for b, members in enumerate(self.buckets):
            offset = 0
            for p in members:
                self._where[id(p)] = (b, offset)
                offset += p.numel()
            self._flat.append(torch.zeros(offset, dtype=members[0].dtype, device=members[0].device))
        self._ready = [0] * len(self.buckets)
        self._seen: set[int] = set()
        self._work: list[Any] = [None] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
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
        b, offset = self._where[id(p)]
        slot = self._flat[b][offset : offset + p.numel()]
        if p.grad.data_ptr() != slot.data_ptr():  # not (yet) a view of the bucket
            slot.copy_(p.grad.reshape(-1))
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._launch(b)

    def _launch(self, b: int) -> None:
        _count(self.counter, "all_reduce", _nbytes(self._flat[b]))
        self._work[b] = dist.all_reduce(self._flat[b], group=self.group, async_op=True)

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
        # Which parameters some rank used, travelling with the last buckets.
        used_of = start_used_mask([id(p) in self._seen for p in self.params], group=self.group,
                                  counter=self.counter)
        for b, members in enumerate(self.buckets):
            if self._work[b] is None:
                # Some parameters produced no gradient (unused this step): their share is 0.
                offset = 0
                for p in members:
                    if id(p) not in self._seen:
                        self._flat[b][offset : offset + p.numel()].zero_()
                    offset += p.numel()
                self._launch(b)
        used = {id(p) for p, u in zip(self.params, used_of(), strict=True) if u}
        for b, members in enumerate(self.buckets):
            self._work[b].wait()
            flat = self._flat[b].div_(self.n)
            offset = 0
            for p in members:
                k = p.numel()
                view = flat[offset : offset + k].view_as(p)
                if id(p) not in used:
                    # No rank produced a gradient: none it is (the optimizer skips it).
                    p.grad = None
                elif self.grad_views:
                    # p.grad becomes a view of the bucket: with zero_grad(set_to_none=False)
                    # autograd accumulates straight into the bucket next step (no copies),
                    # as DDP's gradient_as_bucket_view.
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += k
        self._ready = [0] * len(self.buckets)
        self._seen.clear()
        self._work = [None] * len(self.buckets)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
