"""Transport for the Federated strategy: model broadcast, update upload, control messages.

- ``broadcast_(t, src, group)``: the global model (one flat tensor per dtype) from the
  server rank to every worker (``dist.broadcast``).
- Update upload: one worker's concatenated client update payloads go to the server
  rank with :func:`paratrain.comm.messages.send_bytes` (``header=False``); the
  receiver learns the length from the worker's status message first
  (``recv_bytes(nbytes=...)``), so it never allocates on the strength of an unchecked
  header.
- Control messages (round plans, client status) are small JSON documents in the
  rendezvous store (``TCPStore``); :class:`LocalStore` stands in when the job runs as
  a single process (``group is None``), so the same round loop runs in-process.

With ``group is None`` (one process) the collectives are no-ops.

Each transfer takes an optional ``counter`` (:class:`~paratrain.comm.collectives.CommCounter`)
and books, at the call, the bytes of the tensor it moves: ``broadcast_delivered`` on the
source (the tensor's bytes times the ranks that receive it), ``broadcast_received`` on a
receiver, ``send`` / ``recv`` for the point-to-point payloads. These are measured sizes of
what went through the process group, not a cost model.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommCounter

__all__ = [
    "LocalStore",
    "store_set_json",
    "store_get_json",
    "store_delete",
    "broadcast_",
    "barrier",
    "MAX_JSON_BYTES",
]

MAX_JSON_BYTES = 64 * 1024 * 1024


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


def store_set_json(store: Any, key: str, obj: Any) -> None:
    """Publish ``obj`` as JSON under ``key``."""
    store.set(key, json.dumps(obj, separators=(",", ":")))


def store_get_json(store: Any, key: str) -> Any:
    """Wait for ``key`` (TCPStore ``get`` blocks up to the store timeout) and parse it."""
    raw = store.get(key)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"control message {key!r} is {len(raw)} bytes (limit {MAX_JSON_BYTES})")
    return json.loads(bytes(raw).decode("utf-8"))


def store_delete(store: Any, key: str) -> None:
    """Drop a control message that was read (a missing key is no error). Best effort: the
    keys are per round, so one left behind costs store memory, never a wrong read; a store
    that fails to delete is logged and the run goes on."""
    try:
        store.delete_key(key)
    except Exception as e:  # noqa: BLE001 - whatever the store raised, the key only stays
        logging.getLogger(__name__).warning("control key %r left in the store: %s: %s",
                                            key, type(e).__name__, e)


def broadcast_(tensor: torch.Tensor, *, src: int = 0, group: Any = None,
               counter: CommCounter | None = None) -> None:
    """In-place broadcast of ``tensor`` from ``src`` (no-op for a single process)."""
    if group is None:
        return
    dist.broadcast(tensor, src=src, group=group)
    if counter is not None:
        nb = tensor.numel() * tensor.element_size()
        if dist.get_rank() == src:
            counter.add("broadcast_delivered", nb * (dist.get_world_size(group) - 1))
        else:
            counter.add("broadcast_received", nb)


def barrier(group: Any = None) -> None:
    if group is None:
        return
    dist.barrier(group=group)
