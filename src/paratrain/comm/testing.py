"""Run a function on N real gloo ranks on 127.0.0.1, for tests and benchmarks."""

from __future__ import annotations

import errno
import io
import os
import pickle
import queue
import secrets
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .context import WorkerContext, default_workers
from .forkserver import ParentState
from .forkserver import context as forkserver_context
from .process import leave_process_group


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
    """A TCP port that is free now, for a server another process will bind later: *below* the
    ephemeral range, which the kernel never hands out by itself, so no unrelated socket (a
    ``bind(0)`` or the local end of a connection, e.g. another job's gloo pair) takes it before
    the caller binds. Drawn with the OS's randomness (seeded runs would share ``random``'s)."""
    try:  # where the ephemeral range starts (Linux)
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 49152  # the IANA dynamic range (macOS, BSD)
    low = max(1024, min(20000, high - 1000))
    for _ in range(200):
        port = low + secrets.randbelow(high - low)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # range full: any port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    """True when nothing holds ``port`` on any IPv4 or IPv6 address of this machine."""
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, port))
        except OSError as e:  # (on IPv6 an EAFNOSUPPORT or EADDRNOTAVAIL: no IPv6 here)
            if not (family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)):
                return False
    return True


def _child(rank: int, world_size: int, port: int, parent: ParentState, payload: bytes, results: Any,
           timeout_s: float) -> None:
    parent.apply()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        # Unpickled after apply(): fn may live in a module only the parent's path has.
        fn, args, workers = pickle.loads(payload)  # noqa: S301 - what our parent pickled
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0),  # type: ignore[attr-defined]
                              timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        ctx = WorkerContext(rank=rank, world_size=world_size, local_rank=rank, backend="gloo",
                            group=dist.group.WORLD, store=store, workers=default_workers(world_size, workers))
        out = fn(ctx, *args)
        # Tensors put on a multiprocessing queue travel as shared-memory handles that
        # die with this process; serialise the result to bytes instead.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
        ok = True
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
        ok = False
    finally:
        leave_process_group(synchronize=ok)  # a barrier first when every rank got here


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                    workers: list[Any] | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` (``fn`` module-level) on ``world_size`` gloo ranks forked from
    :mod:`paratrain.comm.forkserver`, joined through a TCPStore on a free port; return the
    results by rank. A failed rank raises ``RuntimeError`` with its traceback. The server
    preloads torch's compiler front end, which every rank building a torch optimizer imports
    (``Optimizer.__init__``'s ``_disable_dynamo``: 1.4 CPU-s a rank otherwise)."""
    ctx = forkserver_context(["torch._dynamo"])
    results = ctx.Queue()
    port = free_port()
    parent = ParentState()
    payload = pickle.dumps((fn, args, workers), protocol=pickle.HIGHEST_PROTOCOL)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, parent, payload, results, timeout_s),
                         daemon=False) for r in range(world_size)]
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
