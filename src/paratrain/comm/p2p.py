"""The pipeline's two transports of activations (forward) and gradients (back).
:class:`P2PTransport`: a message is a 12-element int64 header ``[MAGIC, dtype code, ndim, d_0 ..
d_{ndim-1}, 0 ...]`` on tag ``2t`` and the payload on ``2t + 1``, ``t = code(kind) + 4 * (segment +
8192 * micro)`` (gloo keeps one ``(src, tag)`` in order, so keys are reused every step); with the
row count on both sides a channel's header goes once, as torch's pipelining after its shape
inference. Sends are ``isend``s kept until :meth:`~P2PTransport.flush` (GPipe/1F1B orders stay
deadlock-free with blocking receives). Receives posted ahead (:meth:`~P2PTransport.post`) matter:
gloo moves a payload once its receive is posted (2 busy cores, 256 KiB: 3.4 ms median late, 0.016 ms
posted ahead). :class:`DataStore`: stages hand tensors over as files every worker sees, so a
consumer need not be running when its input is produced; each launch works in a fresh session
directory (:func:`open_session`), so a stale file from a crashed run is never read.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..files import safe_rmtree, write_atomic
from .collectives import nbytes_of

MessageKey = tuple[str, int, int]  # (kind, micro, segment)
HEADER_LEN = 12
_MAGIC = 0x5054_5032  # "PTP2"
_MAX_NDIM = HEADER_LEN - 3
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.uint8, torch.bool,
)
_KINDS = {"act": 0, "grad": 1, "metric": 2, "eval": 3}
_MAX_SEGMENTS = 8192  # message slots: values crossing between ranks x replica pairs
_MAX_MICRO = (2**31 - 1) // (2 * len(_KINDS) * _MAX_SEGMENTS)


def message_tag(key: MessageKey) -> int:
    """The base tag of a message key (header on ``2t``, payload on ``2t + 1``)."""
    kind, micro, segment = key
    if kind not in _KINDS:
        raise ValueError(f"unknown message kind {kind!r}; valid: {', '.join(_KINDS)}")
    if not 0 <= segment < _MAX_SEGMENTS:
        raise ValueError(f"segment index {segment} out of range [0, {_MAX_SEGMENTS})")
    if not 0 <= micro < _MAX_MICRO:
        raise ValueError(f"micro-batch index {micro} out of range [0, {_MAX_MICRO})")
    return _KINDS[kind] + len(_KINDS) * (segment + _MAX_SEGMENTS * micro)


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in DTYPES:
        raise TypeError(f"cannot send dtype {t.dtype}; supported: {DTYPES}")
    if t.dim() > _MAX_NDIM:
        raise ValueError(f"cannot send a {t.dim()}-d tensor (at most {_MAX_NDIM} dims)")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1], h[2] = _MAGIC, DTYPES.index(t.dtype), t.dim()
    if t.dim():
        h[3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _parse_header(h: torch.Tensor, max_elements: int) -> tuple[torch.dtype, tuple[int, ...]]:
    vals = [int(v) for v in h.tolist()]
    if vals[0] != _MAGIC:
        raise RuntimeError(f"p2p: bad header magic {vals[0]:#x}")
    if not 0 <= vals[1] < len(DTYPES):
        raise RuntimeError(f"p2p: unknown dtype code {vals[1]}")
    ndim = vals[2]
    if not 0 <= ndim <= _MAX_NDIM:
        raise RuntimeError(f"p2p: bad ndim {ndim}")
    shape = tuple(vals[3 : 3 + ndim])
    if any(d < 0 for d in shape):
        raise RuntimeError(f"p2p: negative dimension in shape {shape}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise RuntimeError(f"p2p: message of {numel} elements exceeds the limit {max_elements}")
    return DTYPES[vals[1]], shape


class P2PTransport:
    """Send/receive whole tensors between ranks of ``group`` (global ranks)."""

    def __init__(self, group: Any = None, *, device: torch.device | None = None,
                 max_elements: int = 1 << 28) -> None:
        self.group = group
        self.device = device or torch.device("cpu")
        self.max_elements = max_elements
        self._pending: list[tuple[Any, torch.Tensor]] = []
        # (src, key) -> (work, buffer) of receives posted ahead (payload only).
        self._posted: dict[tuple[int, MessageKey], tuple[Any, torch.Tensor]] = {}
        # (peer, kind, segment, rows) -> (dtype, shape) agreed by the first header.
        self._shapes: dict[tuple[int, str, int, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self.bytes_sent = 0
        self.wait_s = 0.0  # time spent blocked in recv (idle, not compute)
        self.posted_count = 0  # receives posted ahead with :meth:`post`

    def send(self, tensor: torch.Tensor, *, dst: int, key: MessageKey, step: int = 0,
             rows: int | None = None) -> None:
        """Post an asynchronous send of ``tensor`` to ``dst`` (``step`` is unused: FIFO tags).
        With ``rows``, later messages of a channel must keep its first one's shape and dtype
        (shape-stable stages, as ``torch.distributed.pipelining``) and go without a header."""
        del step
        tag = message_tag(key)
        payload = tensor.detach().to(self.device).contiguous()
        bufs: list[tuple[torch.Tensor, int]] = []
        channel = None if rows is None else (dst, key[0], key[2], rows)
        meta = (payload.dtype, tuple(payload.shape))
        if channel is None or channel not in self._shapes:
            bufs.append((_header(payload).to(self.device), 2 * tag))
            if channel is not None:
                self._shapes[channel] = meta
        elif self._shapes[channel] != meta:
            raise RuntimeError(f"p2p: {key[0]} to rank {dst} for segment {key[2]} with {rows} rows changed "
                               f"from {self._shapes[channel]} to {meta}; stage outputs must have a fixed "
                               "shape per row count")
        bufs.append((payload, 2 * tag + 1))
        for buf, t in bufs:
            work = dist.isend(buf, dst, group=self.group, tag=t)
            self._pending.append((work, buf))
        self.bytes_sent += nbytes_of(payload)

    def post(self, *, src: int, key: MessageKey, step: int = 0, rows: int | None = None) -> bool:
        """Post the receive of ``key`` from ``src`` now, so its payload can flow early; only on
        a channel whose shape is cached (returns whether one was posted). :meth:`recv` of the
        key waits on it; receives are consumed in the peer's order on each tag."""
        del step
        channel = None if rows is None else (src, key[0], key[2], rows)
        if channel is None or channel not in self._shapes or (src, key) in self._posted:
            return False
        dtype, shape = self._shapes[channel]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, src, group=self.group, tag=2 * message_tag(key) + 1)
        self._posted[(src, key)] = (work, buf)
        self.posted_count += 1
        return True

    def recv(self, *, src: int, key: MessageKey, step: int = 0, rows: int | None = None) -> torch.Tensor:
        """Block until the message ``key`` from ``src`` arrives; return it."""
        del step
        tag = message_tag(key)
        t0 = time.perf_counter()
        posted = self._posted.pop((src, key), None)
        channel = None if rows is None else (src, key[0], key[2], rows)
        if posted is not None:
            work, payload = posted
            work.wait()
        else:
            if channel is not None and channel in self._shapes:
                dtype, shape = self._shapes[channel]
            else:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                dist.recv(header, src, group=self.group, tag=2 * tag)
                dtype, shape = _parse_header(header.cpu(), self.max_elements)
                if channel is not None:
                    self._shapes[channel] = (dtype, shape)
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(payload, src, group=self.group, tag=2 * tag + 1)
        self.wait_s += time.perf_counter() - t0
        return payload

    def flush(self) -> None:
        """Wait for every posted send to complete and release its buffers."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        self.abort()

    def abort(self) -> None:
        """Close after an error: pending sends are dropped, not waited for (a peer that
        failed never receives them), as are receives posted ahead and never consumed; the
        process group's teardown cancels them."""
        self._pending.clear()
        self._posted.clear()


_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}$")


class DataStore:
    """Tensors by key under ``root`` (one file per key)."""

    def __init__(self, root: str | Path, *, timeout_s: float = 300.0,
                 max_bytes: int = 1 << 31) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.wait_s = 0.0
        self.bytes_written = 0

    def path(self, key: str) -> Path:
        if not _KEY.match(key) or ".." in key:
            raise ValueError(f"invalid datastore key {key!r} (letters, digits, '_', '-', '.')")
        return self.root / f"{key}.pt"

    def put(self, key: str, tensor: torch.Tensor) -> Path:
        """Publish ``tensor`` under ``key`` atomically (:func:`paratrain.files.write_atomic`)."""
        dest = self.path(key)
        t = tensor.detach().cpu().contiguous().clone()
        # not durable: a value is consumed at once and never outlives the launch
        write_atomic(dest, lambda tmp: torch.save(t, tmp), durable=False)
        self.bytes_written += nbytes_of(t)
        return dest

    def get(self, key: str, *, timeout_s: float | None = None) -> torch.Tensor:
        """Wait (bounded, polled with back-off) for ``key`` and load it."""
        p = self.path(key)
        limit = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        pause = 0.002
        while not p.exists():
            waited = time.perf_counter() - t0
            if waited >= limit:
                raise TimeoutError(f"datastore: {key!r} did not appear at {p} within {limit:g}s")
            time.sleep(min(pause, max(limit - waited, 0.0)))
            pause = min(pause * 2, 0.05)
        self.wait_s += time.perf_counter() - t0
        size = p.stat().st_size
        if size > self.max_bytes:
            raise RuntimeError(f"datastore: {p} is {size} bytes, over the limit {self.max_bytes}")
        value = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"datastore: {p} does not hold a tensor ({type(value).__name__})")
        return value

    def take(self, key: str, *, timeout_s: float | None = None) -> torch.Tensor:
        """``get`` and delete (each value is consumed exactly once)."""
        value = self.get(key, timeout_s=timeout_s)
        self.path(key).unlink(missing_ok=True)
        return value

    def keys(self) -> list[str]:
        return sorted(p.name[:-3] for p in self.root.glob("*.pt") if not p.name.startswith("."))


def open_session(root: str | Path, *, rank: int, control: Any = None, generation: int = 0,
                 timeout_s: float = 300.0, namespace: str = "run",
                 run_dir: str | Path | None = None) -> DataStore:
    """A DataStore in a fresh session directory ``<root>/<namespace>.session-<id>``, named by
    rank 0 on the ``control`` store (``None``: one process), which deletes earlier sessions of
    ``namespace``; with ``run_dir`` a digest of that run folder joins the namespace, so runs of
    one ``run.name`` in different ``run.output_dir`` never delete each other's live session."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]{1,100}", namespace):
        raise ValueError(f"invalid datastore namespace {namespace!r}")
    if run_dir is not None:
        digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
        namespace = f"{namespace}-{digest}"
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    key = f"paratrain/datastore/session/{generation}"
    prefix = f"{namespace}.session-"
    if rank == 0:
        name = f"{prefix}{uuid.uuid4().hex[:12]}"
        for old in base.glob(f"{prefix}*"):
            if old.is_dir():
                safe_rmtree(old, base)
        (base / name).mkdir()
        if control is not None:
            control.set(key, name)
    else:
        if control is None:
            raise ValueError("a multi-process DataStore session needs the rendezvous store")
        name = bytes(control.get(key)).decode()
        if not re.fullmatch(rf"{re.escape(prefix)}[0-9a-f]{{12}}", name):
            raise RuntimeError(f"datastore: bad session name {name!r}")
    return DataStore(base / name, timeout_s=timeout_s)


class DataStoreTransport:
    """The runtime's transport over a :class:`DataStore`: one file per message, key
    ``s<step>-<kind>-m<micro>-g<segment>-<src>to<dst>``, deleted by the receiver."""

    def __init__(self, store: DataStore, rank: int) -> None:
        self.store = store
        self.rank = rank

    @property
    def wait_s(self) -> float:
        return self.store.wait_s

    @property
    def bytes_sent(self) -> int:
        return self.store.bytes_written

    def _key(self, key: tuple[str, int, int], step: int, src: int, dst: int) -> str:
        kind, micro, segment = key
        return f"s{step:09d}-{kind}-m{micro}-g{segment}-{src}to{dst}"

    def send(self, tensor: torch.Tensor, *, dst: int, key: tuple[str, int, int], step: int = 0,
             rows: int | None = None) -> None:
        """Write the value (``rows`` is unused: every file carries its own shape)."""
        del rows
        self.store.put(self._key(key, step, self.rank, dst), tensor)

    def recv(self, *, src: int, key: tuple[str, int, int], step: int = 0,
             rows: int | None = None) -> torch.Tensor:
        del rows
        return self.store.take(self._key(key, step, src, self.rank))

    def flush(self) -> None:
        """Writes are synchronous; nothing is pending."""

    def abort(self) -> None:
        """Close after an error: the session folder stays (the next launch removes it)."""

    def close(self) -> None:
        """Rank 0 removes the session directory once it is empty (every value consumed), after
        its last receive: another rank could race a peer's pending write."""
        if self.rank != 0:
            return
        with contextlib.suppress(OSError):  # not empty (a value never consumed): it stays
            self.store.root.rmdir()
