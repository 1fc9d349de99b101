"""Every collective outside tensor parallelism's patterns, over a group passed in (``None``: the
default group; without torch.distributed one process, each call returning its input), their
byte count (:func:`nbytes_of`, booked in a :class:`CommCounter`), and the control plane: small
JSON documents (Federated's round plans) in the rendezvous store, or a :class:`LocalStore` in
one process. Nothing received is unpickled; lengths are checked first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

MAX_JSON_BYTES = 64 * 1024 * 1024


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


def count_op(counter: CommCounter | None, op: str, nbytes: int) -> None:
    """Book one ``op`` of ``nbytes`` in ``counter`` (nothing when it is None)."""
    if counter is not None:
        counter.add(op, nbytes)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def global_rank(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (what point-to-point ops and ``src`` take)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def side_group(group: Any = None) -> Any:
    """A gloo group of ``group``'s ranks (None: every rank) for collectives made from another
    thread (an asynchronous checkpoint's writes: two threads must never interleave collectives
    on one group). The whole world's is named by torch's group counter (a hash of the ranks
    would collide with a ``use_local_synchronization`` group of the same ranks, and hang); a
    subgroup's, which its members alone create, by that hash."""
    whole = group is None or group == dist.group.WORLD
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=not whole)


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group`` (no-op for one process)."""
    if world_size(group) > 1:
        dist.barrier(group=group)


def broadcast_(tensor: torch.Tensor, *, src: int = 0, group: Any = None,
               counter: CommCounter | None = None) -> torch.Tensor:
    """In place: ``tensor`` becomes global rank ``src``'s (no-op for one process); returns
    it. ``counter`` books ``broadcast_delivered`` on the source (the bytes times the ranks
    that receive them) and ``broadcast_received`` on a receiver."""
    n = world_size(group)
    if n > 1:
        dist.broadcast(tensor, src=src, group=group)
        if dist.get_rank() == src:
            count_op(counter, "broadcast_delivered", nbytes_of(tensor) * (n - 1))
        else:
            count_op(counter, "broadcast_received", nbytes_of(tensor))
    return tensor


def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Every rank's ``module`` becomes rank ``src``'s (in place), so that the shards cut
    from it fit together whatever randomness a model factory used."""
    if world_size() > 1:
        with torch.no_grad():
            for t in list(module.state_dict().values()):
                broadcast_(t, src=src)


def broadcast_bytes(data: bytes | None, *, src: int = 0, group: Any = None,
                    max_bytes: int = 1 << 40) -> bytes:
    """``src``'s ``data`` on every rank of ``group`` (others pass None): the length, then
    the bytes (a copy in one process)."""
    if world_size(group) == 1:
        return bytes(data or b"")
    mine = rank_of(group) == src
    n = torch.tensor([len(data or b"") if mine else 0], dtype=torch.int64, device=comm_device(group))
    broadcast_(n, src=global_rank(group, src), group=group)
    if not 0 <= int(n.item()) <= max_bytes:
        raise ValueError(f"broadcast_bytes: a message of {int(n.item())} bytes is outside [0, {max_bytes}]")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if mine and data
           else torch.zeros(int(n.item()), dtype=torch.uint8))
    buf = buf.to(comm_device(group))
    if buf.numel():
        broadcast_(buf, src=global_rank(group, src), group=group)
    return bytes(buf.cpu().numpy().tobytes())


def broadcast_json(obj: Any, *, group: Any, src: int = 0, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``src``'s JSON document on every rank (others pass anything, e.g. ``None``)."""
    if world_size(group) == 1:
        return obj
    data = json.dumps(obj, allow_nan=True).encode("utf-8") if rank_of(group) == src else None
    return json.loads(broadcast_bytes(data, src=src, group=group, max_bytes=max_bytes).decode("utf-8"))


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
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=comm_device(group))
    return [int(v) for v in all_reduce_(t, group=group, op="min").tolist()]


def world_mean(values: Sequence[float], device: torch.device | None = None) -> list[float]:
    """Mean of ``values`` over all ranks (one float64 all-reduce); a copy in one process."""
    if world_size() == 1:
        return list(values)
    t = all_reduce_(torch.tensor(list(values), dtype=torch.float64, device=device))
    return (t / world_size()).tolist()


def all_gather_text(text: str, *, group: Any = None, max_bytes: int = 1 << 24) -> list[str]:
    """Every rank's ``text`` (UTF-8), by rank; ``[text]`` in one process."""
    if world_size(group) == 1:
        return [text]
    data = text.encode("utf-8")
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
               else torch.zeros(0, dtype=torch.uint8)).to(comm_device(group))
    return [bytes(t.cpu().tolist()).decode("utf-8", errors="replace")
            for t in all_gather_variable(payload, group=group, max_numel=max_bytes)]


def gather_json(obj: Any, *, group: Any, dst: int = 0, max_bytes: int = MAX_JSON_BYTES) -> list[Any] | None:
    """Every rank's JSON document on rank ``dst`` of ``group`` (rank order); ``None``
    elsewhere. An oversize document fails on every rank together (the lengths travel first)."""
    if world_size(group) == 1:
        return [obj]
    texts = all_gather_text(json.dumps(obj, allow_nan=True), group=group, max_bytes=max_bytes)
    return [json.loads(t) for t in texts] if rank_of(group) == dst else None


def used_mask(local: Sequence[bool], *, group: Any = None, counter: CommCounter | None = None) -> list[bool]:
    """For each entry, whether any rank of ``group`` passed True (one uint8 MAX all-reduce:
    DDP's ``find_unused_parameters`` rule, a parameter no rank used keeps ``grad = None``)."""
    flags = torch.tensor([1 if u else 0 for u in local], dtype=torch.uint8, device=comm_device(group))
    if world_size(group) == 1 or flags.numel() == 0:
        return [bool(u) for u in local]
    count_op(counter, "used_mask", nbytes_of(flags))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in flags.tolist()]


def all_gather_variable(payload: torch.Tensor, *, group: Any = None, counter: CommCounter | None = None,
                        max_numel: int = 1 << 31) -> list[torch.Tensor]:
    """Every rank's 1-D tensor, whose length differs by rank: the lengths (int64), each checked
    against ``max_numel`` on every rank, then the payloads padded to the longest."""
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
        raise ValueError(f"all_gather_variable: a rank announced {bad[0]} elements, outside [0, {max_numel}]")
    padded = torch.zeros(max(lengths), dtype=payload.dtype, device=payload.device)
    padded[: payload.numel()] = payload
    out = [torch.empty_like(padded) for _ in range(n)]
    count_op(counter, "all_gather", nbytes_of(padded) + 8)
    dist.all_gather(out, padded, group=group)
    return [o[:ln] for o, ln in zip(out, lengths, strict=True)]


# Newer torch names the flat collectives ``*_single``, older ones ``*_tensor``.
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_FLAT: dict[tuple[str, str], bool] = {}  # (op, backend) -> whether the backend has the flat op
_UNSUPPORTED = ("does not support", "not supported", "not implemented", "unsupported")


def _has_flat(op: str, like: torch.Tensor, group: Any) -> bool:
    """Whether ``group``'s backend has the flat ``op`` (older gloo has not), probed once per
    backend by one call of one element per rank (every rank's first use of ``op``, so it is
    matched), never by a failing real call, so that a real error (wrong shapes, a dead peer)
    reaches the caller; only "not supported" means no."""
    key = (op, str(dist.get_backend(group)))
    fn, gather = (_AG, True) if op == "all_gather" else (_RS, False)
    if key not in _FLAT:
        p = dist.get_world_size(group)
        out = torch.empty(p if gather else 1, dtype=like.dtype, device=like.device)
        try:
            fn(out, torch.zeros(1 if gather else p, dtype=like.dtype, device=like.device), group=group)
            _FLAT[key] = True
        except NotImplementedError:
            _FLAT[key] = False
        except RuntimeError as e:
            if not any(w in str(e).lower() for w in _UNSUPPORTED):
                raise
            _FLAT[key] = False
    return _FLAT[key]


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` = concatenation of every rank's ``x`` along dim 0 (the work when ``async_op``)."""
    if _has_flat("all_gather", x, group):
        return _AG(out, x, group=group, async_op=async_op)
    return dist.all_gather(list(out.chunk(dist.get_world_size(group))), x, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` = this rank's chunk (dim 0) of the sum of every rank's ``inp``."""
    if _has_flat("reduce_scatter", inp, group):
        return _RS(out, inp, group=group, async_op=async_op)
    full = inp.clone()
    dist.all_reduce(full, group=group)
    out.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return None


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def reduce_scatter(output: torch.Tensor, inputs: torch.Tensor | Sequence[torch.Tensor], *,
                   group: Any = None, average: bool = False, fallback: bool | None = None,
                   counter: CommCounter | None = None) -> torch.Tensor:
    """``output`` <- chunk ``rank`` of the sum (or mean) over ranks of ``inputs``: a flat
    tensor of ``world * output.numel()`` elements or one chunk per rank (sizes may differ).
    Fallback (``fallback=True``, no flat op, or uneven chunks): all-reduce the concatenation
    and copy out this rank's slice."""
    n, rank = world_size(group), rank_of(group)
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
    # a flat input is used as it is (the native op only reads it); chunks are concatenated
    given = isinstance(inputs, torch.Tensor) and inputs.is_contiguous()
    flat = inputs.reshape(-1) if isinstance(inputs, torch.Tensor) and given else torch.cat(
        [c.reshape(-1) for c in chunks])
    native = (all(c.numel() == output.numel() for c in chunks) and not fallback
              and _has_flat("reduce_scatter", flat, group))
    count_op(counter, "reduce_scatter" if native else "reduce_scatter_fallback", nbytes_of(flat))
    if native:
        out_flat = _flat_view(output)
        _RS(out_flat, flat, group=group)
        if out_flat.data_ptr() != output.data_ptr():
            output.copy_(out_flat.view_as(output))
    else:
        flat = flat.clone() if given else flat  # the all-reduce is in place: not the caller's
        dist.all_reduce(flat, group=group)
        start = sum(c.numel() for c in chunks[:rank])
        output.copy_(flat[start : start + output.numel()].view_as(output))
    if average:
        output.div_(n)
    return output


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group: Any = None,
                           fallback: bool | None = None, counter: CommCounter | None = None) -> torch.Tensor:
    """``output`` (``world * input.numel()`` elements) <- the ranks' inputs, concatenated
    (``fallback=True`` or a backend without the flat op: a list all-gather)."""
    n = world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather_into_tensor: output has {output.numel()} elements, need {n} x {input.numel()}"
        )
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return output
    x, out_flat = input.contiguous().reshape(-1), _flat_view(output)
    native = not fallback and _has_flat("all_gather", x, group)
    count_op(counter, "all_gather_into_tensor" if native else "all_gather_fallback", nbytes_of(input))
    if native:
        _AG(out_flat, x, group=group)
    else:
        dist.all_gather(list(out_flat.chunk(n)), x, group=group)
    if out_flat.data_ptr() != output.data_ptr():
        output.copy_(out_flat.view_as(output))
    return output


def consensus_distance(flat: torch.Tensor, *, group: Any = None, counter: CommCounter | None = None) -> float:
    """max_{i,j} ||x_i - x_j||_2 over ranks for this rank's flat parameter vector ``flat``
    (one all-gather of the vectors; every rank returns the same value)."""
    n = world_size(group)
    if n == 1:
        return 0.0
    flat = flat.detach().reshape(-1)
    parts = [torch.empty_like(flat) for _ in range(n)]
    count_op(counter, "all_gather", nbytes_of(flat))
    dist.all_gather(parts, flat, group=group)
    stacked = torch.stack(parts).double()
    return float(torch.cdist(stacked, stacked).max())


class LocalStore:
    """An in-process key-value store with the TCPStore ``set``/``get`` surface."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self._d[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        if key not in self._d:
            raise KeyError(f"control key {key!r} was never set (single-process store)")
        return self._d[key]

    def delete_key(self, key: str) -> bool:
        return self._d.pop(key, None) is not None


def job_store(store: Any, prefix: str) -> Any:
    """``store``'s keys under ``prefix`` (torch's ``PrefixStore``); a :class:`LocalStore` when
    the job runs as one process (``store`` None)."""
    return LocalStore() if store is None else dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]


def store_set_json(store: Any, key: str, obj: Any) -> None:
    store.set(key, json.dumps(obj, separators=(",", ":")))


def store_get_json(store: Any, key: str) -> Any:
    """Wait for ``key`` (TCPStore ``get`` blocks up to the store timeout) and parse it."""
    raw = store.get(key)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"control message {key!r} is {len(raw)} bytes (limit {MAX_JSON_BYTES})")
    return json.loads(bytes(raw).decode("utf-8"))


def store_delete(store: Any, key: str) -> None:
    """Drop a control message that was read; best effort (a key left behind costs store memory,
    never a wrong read: the keys are per round), a failure logged."""
    try:
        store.delete_key(key)
    except Exception as e:  # noqa: BLE001 - whatever the store raised, the key only stays
        logging.getLogger(__name__).warning("control key %r left in the store: %s: %s",
                                            key, type(e).__name__, e)
