"""The Federated strategy's control plane: small JSON documents (round plans, client status)
in the rendezvous store (``TCPStore``), or in a :class:`LocalStore` when the job runs as one
process, so the same round loop runs in-process. The model broadcast and the barrier are
:func:`paratrain.comm.collectives.broadcast_` and :func:`~paratrain.comm.collectives.barrier`
(re-exported here); update payloads travel with :mod:`paratrain.comm.messages`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch.distributed as dist

from .collectives import MAX_JSON_BYTES, barrier, broadcast_

__all__ = ["LocalStore", "job_store", "store_set_json", "store_get_json", "store_delete", "broadcast_", "barrier"]


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
    """Publish ``obj`` as JSON under ``key``."""
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
