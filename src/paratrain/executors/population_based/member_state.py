"""A PBT member's state file, its digest, its seeds and the background writer of its files.

:func:`state_digest` hashes the raw bytes of the model's and optimizer's state (not the
param-group hyperparameters), so a copied member can be checked byte-identical to its
donor; :func:`seed_of` derives the seeds of a member's generation from integers.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...files import write_bytes
from ...training.summary import tensor_bytes


def member_path(run_dir: str | Path, generation: int, member: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"gen-{generation:06d}" / f"member-{member:04d}.pt"


def seed_of(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    h = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the raw bytes of the model's state and the optimizer's per-parameter
    state (momentum buffers, moments, steps), excluding param-group hyperparameters."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(tensor_bytes(t))
    state = optimizer.state_dict()["state"]
    for k in sorted(state):
        for name in sorted(state[k]):
            v = state[k][name]
            h.update(f"{k}.{name}".encode())
            h.update(tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


class CheckpointWriter:
    """Member files written atomically (:func:`paratrain.files.write_atomic`) on one
    background thread, overlapped with the next member's training. ``save`` serialises the
    state at once (later training cannot change what is written); ``flush`` waits for every
    pending file and re-raises a write error: a worker flushes before it reports its
    generation, so no rank reads a member file that is not on disk."""

    def __init__(self) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pbt-ckpt")
        self._pending: list[Future[None]] = []

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, data)

    def save(self, path: Path, state: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        self._pending.append(self._pool.submit(self._write, Path(path), buf.getvalue()))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()
