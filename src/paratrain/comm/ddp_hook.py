"""Compressed gradient exchange, and a DDP communication hook.

:func:`allreduce_compressed`: on every rank the mean over ranks of D(C_r(g_r)) per named
tensor (C_r: rank r's compressor, an error-feedback residual per name). ``None`` and
``RandomK`` (the same k positions on every rank, from seed, step and name) are one
all-reduce; ``TopK`` one all-gather of values and int32/int64 indices, scatter-added
(Aji & Heafield 2017; Lin et al. 2018); ``Threshold`` / ``Quantization`` all-gather their
records (lengths first), parsed with strict checks. ``PowerSGD``
(:mod:`paratrain.compression.powersgd`) all-reduces ``[uncompressed values | P = M Q]``, then
``Q = M^T orthogonalize(P)``: torch's ``powerSGD_hook`` all-reduces three times per bucket;
here the uncompressed values ride with P (same bytes, one latency fewer). Before
``start_step`` a plain mean (DDP's arithmetic: divide, then sum). :func:`ddp_hook` keys state
by parameter name, not bucket index, so residuals survive bucket rebuilds and are checkpointed
with the names exchanged at the current step (a resumed run repeats the uninterrupted one's
draws); ``{"method":"None"}`` takes DDP's own path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..compression import CompressedTensor, Compressor
from ..compression.powersgd import PowerSGDState
from ..config.compression import NoCompression, load_compression
from .collectives import CommCounter, all_reduce_, count_op, nbytes_of, world_size

_T = TypeVar("_T")


def done_future(value: _T) -> torch.futures.Future[_T]:
    """A future already holding ``value`` (nothing to wait for)."""
    fut: torch.futures.Future[_T] = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_powersgd(state: PowerSGDState, named: Named, *, group: Any = None,
                       counter: CommCounter | None = None) -> list[torch.Tensor]:
    """One exchange on the caller's thread: each tensor's mean (approximation) in ``named`` order;
    before ``start_step`` the plain mean. Every rank passes the same names, shapes and order."""
    world = world_size(group)
    if not named:
        return []
    if not state.active():
        flat = torch.cat([t.detach().reshape(-1) for _, t in named]).div_(world)
        all_reduce_(flat, group=group, counter=counter)
        parts = torch.split(flat, [t.numel() for _, t in named])
        return [p.view(t.shape) for p, (_, t) in zip(parts, named, strict=True)]
    rnd = state.begin(named)
    all_reduce_(rnd.first, group=group, counter=counter)
    all_reduce_(rnd.second(), group=group, counter=counter)
    return rnd.finish(world)


def mean_bucket(buf: torch.Tensor, group: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP bucket's mean with DDP's own arithmetic: divide by the world size, then sum."""
    buf.div_(world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return cast("torch.futures.Future[torch.Tensor]", fut.then(lambda f: f.value()[0]))


def powersgd_bucket_hook(state: PowerSGDState, bucket: Any, names: list[str], group: Any
                         ) -> torch.futures.Future[torch.Tensor]:
    """One DDP bucket (``dist.GradBucket``) through PowerSGD, keyed by ``names`` (one per
    bucket gradient): the means are written into the bucket's gradient views, as torch's
    hook does. A bucket is one exchange (one fresh-Q seed draw, as torch's hook per bucket)."""
    buf: torch.Tensor = bucket.buffer()
    if not state.active():
        return mean_bucket(buf, group)
    grads = bucket.gradients()
    world = world_size(group)
    rnd = state.begin(list(zip(names, grads, strict=True)))
    if world == 1:
        rnd.second()
        rnd.finish(1, grads)
        return done_future(buf)
    first = dist.all_reduce(rnd.first, group=group, async_op=True).get_future()

    def after_first(_f: Any) -> torch.Tensor:
        q = rnd.second()
        # Blocking inside the callback, as torch's hook does: the chain stays one future.
        dist.all_reduce(q, group=group, async_op=True).get_future().wait()
        rnd.finish(world, grads)
        return buf

    return cast("torch.futures.Future[torch.Tensor]", first.then(after_first))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


Named = Sequence[tuple[str, torch.Tensor]]
Finish = Callable[[], list[torch.Tensor]]


@dataclass
class _Pending:
    """A launched exchange: the collective's work handle (None when nothing is in
    flight) and the function that turns the received buffers into the means."""

    work: Any
    finish: Finish
    nbytes: int = 0  # what this rank puts on the wire
    op: str = "all_reduce"

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        return self.finish()

    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        if self.work is None:
            return done_future(self.finish())
        return cast("torch.futures.Future[list[torch.Tensor]]", self.work.get_future().then(lambda _f: self.finish()))


def _split_mean(flat: torch.Tensor, named: Named, world: int) -> list[torch.Tensor]:
    parts = torch.split(flat, [t.numel() for _, t in named])
    return [p.div(world).to(t.dtype).reshape(t.shape) for p, (_, t) in zip(parts, named, strict=True)]


def _launch_dense(compressor: Compressor, named: Named, group: Any, world: int) -> _Pending:
    dense = [compressor.roundtrip(k, t).reshape(-1) for k, t in named]
    flat = torch.cat([d.to(_acc_dtype(d.dtype)) for d in dense])
    work = dist.all_reduce(flat, group=group, async_op=True) if world > 1 else None
    return _Pending(work, lambda: _split_mean(flat, named, world), nbytes_of(flat))


def _launch_randomk(compressor: Compressor, named: Named, group: Any, world: int) -> _Pending:
    recs = [compressor.compress(k, t) for k, t in named]
    vals = torch.cat([c.values.to(_acc_dtype(c.dtype)) for c in recs])
    work = dist.all_reduce(vals, group=group, async_op=True) if world > 1 else None

    def finish() -> list[torch.Tensor]:
        out, off = [], 0
        for (_, t), c in zip(named, recs, strict=True):
            assert c.indices is not None
            dense = torch.zeros(t.numel(), dtype=vals.dtype, device=t.device)
            dense.index_copy_(0, c.indices.to(t.device), vals[off : off + c.k])
            off += c.k
            out.append(dense.div_(world).to(t.dtype).reshape(t.shape))
        return out

    return _Pending(work, finish, nbytes_of(vals))


def _launch_topk(compressor: Compressor, named: Named, group: Any, world: int) -> _Pending:
    recs = [compressor.compress(k, t) for k, t in named]
    device = named[0][1].device
    acc = _acc_dtype(named[0][1].dtype)
    *offsets, total = accumulate((t.numel() for _, t in named), initial=0)
    # Global positions in the concatenation of all tensors; int32 halves the index bytes.
    idx_dtype = torch.int32 if total < (1 << 31) else torch.int64
    idx = torch.cat([c.indices.to(device) + o for c, o in zip(recs, offsets, strict=True)
                     if c.indices is not None]).to(idx_dtype)
    vals = torch.cat([c.values.to(acc) for c in recs])
    # One all-gather of [values | indices] as bytes (every rank sends the same count).
    nv = nbytes_of(vals)
    payload = torch.cat([vals.view(torch.uint8), idx.view(torch.uint8)])
    if world > 1:
        gathered = [torch.empty_like(payload) for _ in range(world)]
        work = dist.all_gather(gathered, payload, group=group, async_op=True)
    else:
        gathered, work = [payload], None

    def finish() -> list[torch.Tensor]:
        flat = torch.zeros(total, dtype=acc, device=device)
        for g in gathered:
            v = g[:nv].clone().view(acc)
            i = g[nv:].clone().view(idx_dtype)
            flat.index_add_(0, i.to(torch.int64), v)
        return _split_mean(flat, named, world)

    return _Pending(work, finish, nbytes_of(payload), "all_gather")


def _launch_bytes(compressor: Compressor, named: Named, group: Any, world: int) -> _Pending:
    device = named[0][1].device
    blobs = [compressor.compress(k, t).to_bytes() for k, t in named]
    lengths = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=device)
    payload = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).to(device)
    work, wire = None, 0
    if world > 1:
        # Record sizes differ per rank (Threshold counts): exchange them first (blocking),
        # then all-gather the payloads padded to the largest.
        all_lengths = [torch.empty_like(lengths) for _ in range(world)]
        dist.all_gather(all_lengths, lengths, group=group)
        sizes = [int(x.sum()) for x in all_lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(world)]
        work = dist.all_gather(gathered, padded, group=group, async_op=True)
        wire = nbytes_of(lengths) + nbytes_of(padded)
    else:
        all_lengths, gathered = [lengths], [payload]

    def finish() -> list[torch.Tensor]:
        sums = [torch.zeros(t.numel(), dtype=_acc_dtype(t.dtype), device=device) for _, t in named]
        for lens, buf in zip(all_lengths, gathered, strict=True):
            data = buf.cpu().numpy().tobytes()
            pos = 0
            for j, ln in enumerate(lens.tolist()):
                t = named[j][1]
                c = CompressedTensor.from_bytes(data[pos : pos + ln], expect_shape=tuple(t.shape),
                                                expect_dtype=t.dtype, max_numel=t.numel())
                pos += ln
                sums[j] += c.decompress().reshape(-1).to(device=device, dtype=sums[j].dtype)
        return [s.div_(world).to(t.dtype).reshape(t.shape) for s, (_, t) in zip(sums, named, strict=True)]

    return _Pending(work, finish, wire, "all_gather")


def _launch(compressor: Compressor, named: Named, group: Any) -> _Pending:
    if not named:
        return _Pending(None, list)
    launch = {"None": _launch_dense, "RandomK": _launch_randomk, "TopK": _launch_topk}
    return launch.get(compressor.method, _launch_bytes)(compressor, named, group, world_size(group))


def allreduce_compressed(compressor: Compressor, named: Sequence[tuple[str, torch.Tensor]], *,
                         group: Any = None, counter: Any = None) -> list[torch.Tensor]:
    """Mean over ranks of D(C_r(t_r)) for each ``(name, tensor)``, in ``named``'s order and
    each tensor's dtype (accumulated in float32 for float16/bfloat16). Every rank passes the
    same names, shapes and dtypes, with compressors of one strategy and seed at one step;
    ``counter`` books the bytes this rank sent."""
    if compressor.powersgd is not None:
        named = list(named)
        state = compressor.powersgd
        if named and world_size(group) > 1:
            size = named[0][1].element_size()
            compressor.stats.record(size * sum(t.numel() for _, t in named),
                                    size * state.wire_numel([tuple(t.shape) for _, t in named]))
        return allreduce_powersgd(state, named, group=group, counter=counter)
    pending = _launch(compressor, list(named), group)
    if pending.work is not None:
        count_op(counter, pending.op, pending.nbytes)
    return pending.wait()


class CompressionHookState:
    """State of the DDP hook: the Compressor, the group and parameter names."""

    def __init__(self, strategy: Any, *, model: torch.nn.Module | None = None, process_group: Any = None,
                 seed: int = 0, stochastic_rounding: bool = True) -> None:
        self.strategy = load_compression(strategy)
        self.compressor = Compressor(self.strategy, seed=seed, stochastic_rounding=stochastic_rounding)
        self.process_group = process_group
        self.plain = isinstance(self.strategy, NoCompression)
        self._names: dict[int, str] = {}
        if model is not None:
            inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            self._names = {id(p): n for n, p in inner.named_parameters()}
        self._auto_names = model is None
        self._seen: set[str] = set()

    def name_of(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        if name is None:
            if not self._auto_names:
                raise KeyError("parameter not found in the model passed to ddp_hook")
            # Without a model, names follow first-seen order (deterministic across ranks).
            name = f"param{len(self._names)}"
            self._names[id(param)] = name
        return name

    def step(self) -> int:
        self._seen.clear()
        return self.compressor.step()

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state plus the names already exchanged at its current step
        (``seen``): the step advances lazily, when the next backward pass meets a name
        again, so ``seen`` tells a loaded hook to advance before its first exchange."""
        return {"compressor": self.compressor.state_dict(), "seen": sorted(self._seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        # A state without "seen" (older checkpoints) resumes at the saved step as is.
        self._seen = {str(n) for n in state.get("seen", ())}


def _hook(state: CompressionHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Compress this bucket's gradients by parameter name and launch the exchange
    asynchronously; the returned future writes the means into the bucket buffer."""
    group = state.process_group
    buf: torch.Tensor = bucket.buffer()
    if state.plain:
        return mean_bucket(buf, group)
    params = bucket.parameters()
    names = [state.name_of(p) for p in params]
    if state._seen.intersection(names):
        state.step()
    state._seen.update(names)
    if state.compressor.powersgd is not None:
        return powersgd_bucket_hook(state.compressor.powersgd, bucket, names, group)
    grads = bucket.gradients()
    pending = _launch(state.compressor, list(zip(names, grads, strict=True)), group)

    def write_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        off = 0
        for g, a in zip(grads, fut.value(), strict=True):
            buf[off : off + g.numel()].copy_(a.reshape(-1))
            off += g.numel()
        return buf

    # The collective runs while autograd computes the next buckets' gradients.
    return pending.future().then(write_back)


Hook = Callable[[CompressionHookState, Any], torch.futures.Future[torch.Tensor]]
# DDP inspects the hook's annotations and compares them with the real objects, which
# postponed (string) annotations would fail.
_hook.__annotations__ = {
    "state": CompressionHookState,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]  # torch does not re-export it
    "return": torch.futures.Future[torch.Tensor],
}


def ddp_hook(strategy: Any, *, model: torch.nn.Module | None = None, process_group: Any = None,
             seed: int = 0, stochastic_rounding: bool = True) -> tuple[CompressionHookState, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``; with ``model`` (the
    DDP module or the one it wraps) residuals are keyed by parameter name, without it by
    first-seen order. Every rank uses the same strategy and seed."""
    return CompressionHookState(strategy, model=model, process_group=process_group, seed=seed,
                                stochastic_rounding=stochastic_rounding), _hook
