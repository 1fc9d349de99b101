"""The process-group lifecycle of one worker (the only place that joins and leaves the
default group): :func:`join_process_group` from the launcher's environment, returning the
:class:`~paratrain.comm.context.WorkerContext`; :func:`process_group` around a ``with`` block.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..config import ConfigError
from .context import WorkerContext, default_workers
from .rendezvous import gloo_interface, group_prefix


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``run.device``: ``auto`` = CUDA when available (one GPU per local rank, round robin),
    else CPU; the one device rule of every strategy (one process: local rank 0)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError([("run.device", "'cuda' requested but CUDA is not available")])
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _backend(job: Any, device: torch.device) -> str:
    backend: str = job.run.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "nccl" and device.type == "cuda" and local_world > torch.cuda.device_count():
        raise ConfigError([(
            "run.backend",
            f"NCCL needs one GPU per process: {local_world} processes on this node but "
            f"{torch.cuda.device_count()} GPU(s); set run.backend = \"gloo\" or use fewer processes",
        )])
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError([("run.backend", "nccl needs CUDA devices; use gloo on CPU")])
    return backend


def join_process_group(job: Any) -> WorkerContext:
    """Join the default process group from the environment; return the WorkerContext. A group
    a caller already joined is reused, the control plane under its default store."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(job.run.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    backend = _backend(job, device)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = timedelta(seconds=job.comm.timeout_s)
    store: Any
    if not dist.is_initialized():
        # The agent's one TCPStore outlives restart attempts: an earlier group's keys (gloo's
        # peer addresses of dead processes) must not be read, hence a fresh prefix.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        base = dist.TCPStore(  # type: ignore[attr-defined]  # not re-exported by torch
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
            is_master=(not agent_store and rank == 0), timeout=timeout)
        store = dist.PrefixStore(group_prefix(base, rank=rank, world_size=world_size,  # type: ignore[attr-defined]
                                              timeout=timeout), base)
        if backend == "gloo":  # peers on other machines must reach this one
            ifname = gloo_interface(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            if ifname is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
    else:
        store = dist.PrefixStore("paratrain/", dist.distributed_c10d._get_default_store())  # type: ignore[attr-defined]
    control = dist.PrefixStore("control/", store)  # type: ignore[attr-defined]
    return WorkerContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                         backend=backend, group=dist.group.WORLD, store=control,
                         workers=default_workers(world_size, list(job.workers)),
                         restart_count=restart_count)


def leave_process_group(*, synchronize: bool = True) -> None:
    """Destroy the default process group (and its subgroups); best effort.

    ``synchronize`` (every rank is leaving normally): a barrier first. A finished worker was
    sometimes aborted at exit (exit -6, which the elastic agent takes for a failure): gloo's
    ``pt_gloo_runloop`` thread drops a completed work holding the last reference to a tensor
    and takes the GIL to free it during interpreter finalization, where ``pthread_exit`` ends
    it and the unwind through torch's noexcept frames calls ``std::terminate`` (seen in gdb).
    The barrier narrows the window (under load: 5 of 120 processes aborted without it, 2 of
    340 with it); :func:`exit_process` closes it. No barrier after an error: the others may
    never reach it."""
    if dist.is_initialized():
        with suppress(Exception):  # best effort on the way out
            if synchronize and dist.get_world_size() > 1:
                dist.barrier()
        with suppress(Exception):
            dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` as a finished worker should, without interpreter
    finalization (the exit abort :func:`leave_process_group` describes happens only then):
    non-daemon threads joined, the ``atexit`` functions run, stdout and stderr flushed, then
    ``os._exit``, as :mod:`multiprocessing` ends every child it starts. ``python -m
    paratrain.worker`` (the torchrun entry) ends here; every file paratrain writes is closed
    by a ``with`` block before this point."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with suppress(Exception):  # a closed or broken stream: nothing to keep
                stream.flush()
        os._exit(code)


@contextmanager
def process_group(job: Any) -> Iterator[WorkerContext]:
    """Join the default group for the block; leave it afterwards if this call joined it."""
    owns_group = not dist.is_initialized()
    ok = False
    try:
        yield join_process_group(job)
        ok = True
    finally:
        if owns_group:
            leave_process_group(synchronize=ok)
