"""Run a function on N real gloo ranks on 127.0.0.1 (for tests and benchmarks).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, joins them
into one gloo process group through a TCPStore on a free port, calls
``fn(ctx, *args)`` in each with a :class:`WorkerContext`, and returns the per-rank
results (in rank order). A failure on any rank raises ``RuntimeError`` carrying that
rank's traceback. ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .context import WorkerContext, default_workers

__all__ = ["free_port", "run_distributed"]


def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs besides tensors and plain Python
    values to rebuild the NumPy arrays and scalars workers may return (no other code)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    kinds = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128")
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
            *(type(np.dtype(k)) for k in kinds)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    workers: list[Any] | None,
    timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=(rank == 0),
            timeout=timedelta(seconds=timeout_s),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        ctx = WorkerContext(
            rank=rank, world_size=world_size, local_rank=rank, backend="gloo",
            group=dist.group.WORLD, store=store,
            workers=default_workers(world_size, workers),
        )
        out = fn(ctx, *args)
        # Tensors put on a multiprocessing queue travel as shared-memory handles that
        # die with this process; serialise the result to bytes instead.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    workers: list[Any] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, fn, args, results, workers, timeout_s),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout_s + 30)
            except queue.Empty:
                errors.append(f"timed out after {timeout_s}s waiting for ranks")
                break
            if ok:
                with torch.serialization.safe_globals(_numpy_globals()):
                    out[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]
