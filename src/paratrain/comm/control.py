"""The control plane: small JSON messages over the rendezvous TCPStore.

Tensors travel through collectives; plans, statuses and heartbeats travel here, as
UTF-8 JSON (nothing is unpickled, every value is bounded by ``max_bytes``). Keys are
namespaced by the store's prefix (one per restart attempt, see ``paratrain.worker``).

``ControlPlane(store, rank=..., world_size=...)``:

* ``publish(key, obj)`` / ``read(key, timeout_s=...)`` — one writer, many readers;
* ``broadcast(name, obj, src=0)`` — src publishes, everyone returns the value;
* ``gather(name, obj, dst=0)`` — every rank publishes ``name/<rank>``, dst reads all;
* ``barrier(name)`` — a counter (``store.add``) plus a wait; no process group needed;
* ``heartbeat()`` / ``last_heartbeat(rank)`` — wall-clock liveness stamps;
* ``counter(name, delta)`` — an atomic shared integer.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

__all__ = ["ControlPlane", "ControlError"]

MAX_BYTES = 1 << 20


class ControlError(RuntimeError):
    """A control-plane message was missing (timeout), oversized or not valid JSON."""


class ControlPlane:
    """JSON messages over a ``torch.distributed.Store`` (TCPStore, PrefixStore, ...)."""

    def __init__(
        self, store: Any, *, rank: int, world_size: int, timeout_s: float = 300.0,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        if store is None:
            raise ValueError("ControlPlane needs a store (got None: single-process run?)")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._barriers: dict[str, int] = {}

    @classmethod
    def from_context(cls, ctx: Any, **kwargs: Any) -> ControlPlane:
        return cls(ctx.store, rank=ctx.rank, world_size=ctx.world_size, **kwargs)

    # -- point messages ------------------------------------------------------------
    def publish(self, key: str, obj: Any) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        if len(data) > self.max_bytes:
            raise ControlError(f"control message {key!r} is {len(data)} bytes (limit {self.max_bytes})")
        self.store.set(key, data)

    def read(self, key: str, *, timeout_s: float | None = None) -> Any:
        self._wait([key], timeout_s)
        raw = self.store.get(key)
        if len(raw) > self.max_bytes:
            raise ControlError(f"control message {key!r} is {len(raw)} bytes (limit {self.max_bytes})")
        try:
            return json.loads(bytes(raw).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ControlError(f"control message {key!r} is not JSON: {e}") from None

    def exists(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001 - not every store supports deletion
            pass

    def _wait(self, keys: list[str], timeout_s: float | None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait(keys, timedelta(seconds=t))
        except Exception as e:  # noqa: BLE001 - the store raises a bare RuntimeError/DistError
            raise ControlError(f"timed out after {t}s waiting for {keys}: {e}") from None

    # -- group patterns ------------------------------------------------------------
    def broadcast(self, name: str, obj: Any = None, *, src: int = 0) -> Any:
        key = f"bcast/{name}"
        if self.rank == src:
            self.publish(key, obj)
            return obj
        return self.read(key)

    def gather(self, name: str, obj: Any, *, dst: int = 0) -> list[Any] | None:
        self.publish(f"gather/{name}/{self.rank}", obj)
        if self.rank != dst:
            return None
        return [self.read(f"gather/{name}/{r}") for r in range(self.world_size)]

    def all_gather(self, name: str, obj: Any) -> list[Any]:
        self.publish(f"allgather/{name}/{self.rank}", obj)
        return [self.read(f"allgather/{name}/{r}") for r in range(self.world_size)]

    def barrier(self, name: str = "barrier", *, timeout_s: float | None = None) -> None:
        """Every rank calls it with the same name; returns once all have arrived.

        The n-th use of a name is a new barrier (the name is suffixed by a local count).
        """
        k = self._barriers.get(name, 0)
        self._barriers[name] = k + 1
        key = f"barrier/{name}/{k}"
        arrived = int(self.store.add(key, 1))
        if arrived == self.world_size:
            self.store.set(f"{key}/done", b"1")
        self._wait([f"{key}/done"], timeout_s)

    def counter(self, name: str, delta: int = 1) -> int:
        return int(self.store.add(f"counter/{name}", delta))

    # -- liveness ------------------------------------------------------------------
    def heartbeat(self) -> None:
        self.store.set(f"heartbeat/{self.rank}", str(time.time()).encode())

    def last_heartbeat(self, rank: int) -> float | None:
        key = f"heartbeat/{rank}"
        if not self.exists(key):
            return None
        return float(bytes(self.store.get(key)).decode())
