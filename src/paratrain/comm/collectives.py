"""Collectives on torch.distributed: the communication counter, the small wrappers
(barrier, broadcast, all-reduce, min of ints, text all-gather), the used-parameter mask,
variable-size all-gather, reduce-scatter / all-gather-into-tensor with fallbacks for ops a
backend lacks, and the consensus distance of replicas.

Bucketed all-reduce and the overlapped gradient reducer live in
:mod:`paratrain.comm.buckets`; point-to-point byte and tensor messages in
:mod:`paratrain.comm.messages`.

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CommCounter",
    "count_op",
    "nbytes_of",
    "all_gather_variable",
    "all_min_ints",
    "all_gather_text",
    "broadcast_bytes",
    "rank_of",
    "barrier",
    "broadcast_",
    "all_reduce_",
    "used_mask",
    "start_used_mask",
    "reduce_scatter",
    "all_gather_into_tensor",
    "world_size",
    "consensus_distance",
    "comm_device",
]

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


def count_op(counter: CommCounter | None, op: str, nbytes: int) -> None:
    """Book one ``op`` of ``nbytes`` in ``counter`` (nothing when it is None)."""
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
        count_op(counter, "broadcast", nbytes_of(tensor))
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_bytes(data: bytes | None, *, src: int = 0, group: Any = None) -> bytes:
    """``src``'s ``data`` on every rank of ``group`` (others pass None): the length, then
    the bytes (a copy in one process)."""
    if world_size(group) == 1:
        return bytes(data or b"")
    mine = rank_of(group) == src
    n = torch.tensor([len(data or b"") if mine else 0], dtype=torch.int64, device=comm_device(group))
    dist.broadcast(n, src=src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if mine and data
           else torch.zeros(int(n.item()), dtype=torch.uint8))
    buf = buf.to(comm_device(group))
    if buf.numel():
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


def all_reduce_(tensor: torch.Tensor, *, group: Any = None, op: str = "sum",
                counter: CommCounter | None = None) -> torch.Tensor:
    """In place: the element-wise ``op`` (``sum`` | ``max`` | ``min``) over the ranks."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce_: unknown op {op!r}; valid: {', '.join(ops)}")
    if world_size(group) > 1:
        count_op(counter, "all_reduce", nbytes_of(tensor))
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
    count_op(counter, "used_mask", nbytes_of(flags))
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait() -> list[bool]:
        work.wait()
        return [bool(v) for v in flags.tolist()]

    return wait


def used_mask(local: Sequence[bool], *, group: Any = None, counter: CommCounter | None = None) -> list[bool]:
    """For each entry, whether any rank of ``group`` passed True (one uint8 MAX all-reduce)."""
    return list(start_used_mask(local, group=group, counter=counter)())


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


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
    count_op(counter, "all_gather", nbytes_of(padded) + 8)
    dist.all_gather(out, padded, group=group)
    return [o[:ln] for o, ln in zip(out, lengths, strict=True)]


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
        inputs.reshape(-1).split(output.numel())  # type: ignore[no-untyped-call]
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
            count_op(counter, "reduce_scatter", nbytes_of(flat))
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
    count_op(counter, "reduce_scatter_fallback", nbytes_of(flat))
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
            count_op(counter, "all_gather_into_tensor", nbytes_of(input))
            dist.all_gather_into_tensor(out_flat, input.contiguous().reshape(-1), group=group)
            if out_flat.data_ptr() != output.data_ptr():
                output.copy_(out_flat.view_as(output))
            return output
        except (RuntimeError, NotImplementedError) as e:
            if not _native_failed(e):
                raise
            _UNSUPPORTED.add((_backend(group), "all_gather"))
    parts = [torch.empty_like(input.reshape(-1)) for _ in range(n)]
    count_op(counter, "all_gather_fallback", nbytes_of(input))
    dist.all_gather(parts, input.contiguous().reshape(-1), group=group)
    output.copy_(torch.cat(parts).view_as(output))
    return output


def consensus_distance(flat: torch.Tensor, *, group: Any = None, counter: CommCounter | None = None) -> float:
    """max_{i,j} ||x_i - x_j||_2 over ranks for this rank's flat parameter vector ``flat``.

    One all-gather of the vectors; every rank returns the same value.
    """
    n = world_size(group)
    if n == 1:
        return 0.0
    flat = flat.detach().reshape(-1)
    parts = [torch.empty_like(flat) for _ in range(n)]
    count_op(counter, "all_gather", nbytes_of(flat))
    dist.all_gather(parts, flat, group=group)
    stacked = torch.stack(parts).double()
    return float(torch.cdist(stacked, stacked).max())
