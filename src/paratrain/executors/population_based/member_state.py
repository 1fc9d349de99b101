"""A PBT member's state on disk: where it lives, its digest, its seeds, and the
background writer of its checkpoint files.

A member's state at the end of generation ``g`` lives in
``checkpoints/gen-<g>/member-<i>.pt`` (model, optimizer and lr-scheduler ``state_dict``,
written atomically, by :class:`CheckpointWriter` on a background thread).
:func:`state_digest` hashes the raw bytes of the model's and optimizer's state (not the
param-group hyperparameters), so a copied member can be checked byte-identical to its
donor. :func:`seed_of` derives the seeds of a member's generation from integers.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...files import write_atomic, write_bytes
from ...training.summary import tensor_bytes

__all__ = ["member_path", "state_digest", "seed_of", "copy_atomic", "CheckpointWriter"]


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


def copy_atomic(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` (:func:`paratrain.files.write_atomic`)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dst, lambda tmp: shutil.copyfile(src, tmp))


class CheckpointWriter:
    """Atomic checkpoint files written in a background thread.

    ``save`` serialises the state into memory at once (later training cannot change
    what is written) and hands the bytes to one writer thread, which writes a temp file
    in the target folder, fsyncs it and ``os.replace``s it into place
    (:func:`paratrain.files.write_atomic`) — the same
    guarantees as :func:`paratrain.training.checkpoint.save_checkpoint`, overlapped with
    the next member's training. ``flush`` waits for every pending file and re-raises a
    write error; a worker flushes before reporting its generation, so a population
    checkpoint never refers to a member file that is not on disk.
    """

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

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the writer thread, after every file queued before it."""
        self._pending.append(self._pool.submit(fn, *args))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()
