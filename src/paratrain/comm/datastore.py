"""A shared-directory tensor store: ModelParallel's ``DataStore`` protocol. Stages hand
activations and gradients over as files every worker can see, so a consumer need not be
running when its input is produced: written atomically, ``torch.load(weights_only=True)``
after a size check, polled with back-off (2 ms up to 50 ms) up to ``timeout_s`` (a
``TimeoutError`` names key and path), deleted once consumed. Every launch works in a fresh
session directory agreed through the rendezvous store; rank 0 removes earlier launches'
sessions, so a stale file from a crashed run is never read.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ..files import write_atomic
from .collectives import nbytes_of

_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}$")
_SESSION_PREFIX = "session-"


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

    def get(self, key: str, *, timeout_s: float | None = None, delete: bool = False) -> torch.Tensor:
        """Wait (bounded) for ``key`` and load it; ``delete=True`` removes it after reading."""
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
        if delete:
            p.unlink(missing_ok=True)
        return value

    def take(self, key: str, *, timeout_s: float | None = None) -> torch.Tensor:
        """``get`` and delete (each value is consumed exactly once)."""
        return self.get(key, timeout_s=timeout_s, delete=True)

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
    prefix = f"{namespace}.{_SESSION_PREFIX}"
    if rank == 0:
        name = f"{prefix}{uuid.uuid4().hex[:12]}"
        from ..files import safe_rmtree

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
        try:
            self.store.root.rmdir()
        except OSError:
            pass
