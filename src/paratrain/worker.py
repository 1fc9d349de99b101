"""One worker process: ``python -m paratrain.worker JOB [--resume]`` (under torchrun).

:func:`worker_entry` is what the elastic launcher runs in every process (it must be a
module-level function so ``spawn`` can pickle it). It joins the default process group
from the environment the launcher set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...),
builds the :class:`~paratrain.comm.context.WorkerContext` and calls the strategy's
``worker_main(ctx, job, resume)``. A restart by the elastic agent
(``TORCHELASTIC_RESTART_COUNT > 0``) resumes from the last checkpoint.

As a command it loads the job file and dispatches it through
:func:`paratrain.executors.execute`; the executor's ``launch`` sees torchrun's
environment and runs in-process, so the same job file runs across machines::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:PORT \\
        -m paratrain.worker job.toml
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from datetime import timedelta
from typing import Any

__all__ = ["worker_entry", "build_context", "resolve_device", "main"]


def resolve_device(requested: str, local_rank: int) -> Any:
    """``auto`` = CUDA when available (one GPU per local rank, round robin), else CPU."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        from .config import ConfigError

        raise ConfigError([("run.device", "cuda requested but torch.cuda.is_available() is False")])
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_context(job: Any) -> Any:
    """Join the default process group from the environment; return the WorkerContext."""
    import torch
    import torch.distributed as dist

    from .comm.context import WorkerContext, default_workers

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(job.run.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    backend = job.run.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "nccl" and device.type == "cuda" and local_world > torch.cuda.device_count():
        from .config import ConfigError

        raise ConfigError([(
            "run.backend",
            f"NCCL needs one GPU per process: {local_world} processes on this node but "
            f"{torch.cuda.device_count()} GPU(s); set run.backend = \"gloo\" or use fewer processes",
        )])
    if backend == "nccl" and device.type != "cuda":
        from .config import ConfigError

        raise ConfigError([("run.backend", "nccl needs CUDA devices; use gloo on CPU")])
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = timedelta(seconds=job.comm.timeout_s)
    if not dist.is_initialized():
        # The elastic agent shares one TCPStore across restart attempts, so keys written
        # by the group of attempt k (gloo's peer addresses) would be read by attempt k+1
        # and point at dead processes. Every attempt gets its own key prefix.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=(not agent_store and rank == 0),
            timeout=timeout,
        )
        store = dist.PrefixStore(f"paratrain/attempt_{restart_count}/", base)
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **kwargs,
        )
    else:
        store = dist.PrefixStore("paratrain/", dist.distributed_c10d._get_default_store())
    control = dist.PrefixStore("control/", store)
    return WorkerContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        group=dist.group.WORLD,
        store=control,
        workers=default_workers(world_size, list(job.workers)),
        restart_count=restart_count,
    )


def _resolve_target(job: Any, target: str | None) -> Any:
    if target is None:
        from .executors import executor_module

        # executor_module, not EXECUTORS[type]: a Local/DataParallel job with
        # tensor_parallel_size > 1 runs on the tensor-parallel executor.
        module = importlib.import_module(executor_module(job))
        fn = getattr(module, "worker_main", None)
        if fn is None:
            raise TypeError(f"strategy {job.strategy.type} has no multi-process worker_main")
        return fn
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr or "worker_main")


def worker_entry(job_json: dict[str, Any], resume: bool, target: str | None = None) -> Any:
    """Entry point of every worker process (see module docstring)."""
    import torch.distributed as dist

    from .config.job import JobConfig

    job = JobConfig.model_validate(job_json)
    if job.run.imports:
        # Plugins (models, datasets, coordinators) must be registered in every process.
        from pathlib import Path

        from .executors.custom import import_plugins

        base = os.environ.get("PARATRAIN_JOB_DIR")
        import_plugins(list(job.run.imports), base=Path(base) if base else None)
    owns_group = not dist.is_initialized()
    ctx = build_context(job)
    from .training.gcfreeze import freeze_startup_objects

    freeze_startup_objects()  # no 100 ms full GC pass inside a step (a straggler rank)
    resume = bool(resume) or ctx.restart_count > 0
    try:
        return _resolve_target(job, target)(ctx, job, resume)
    finally:
        if owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.worker")
    parser.add_argument("job", help="job file (.toml, .json, .yaml)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    args = parser.parse_args(argv)
    from .config import ConfigError
    from .config.job import load_job
    from .executors import execute

    try:
        job = load_job(args.job)
        job_dir = os.path.dirname(os.path.abspath(args.job))
        os.environ.setdefault("PARATRAIN_JOB_DIR", job_dir)
        from pathlib import Path

        execute(job, resume=args.resume, job_dir=Path(job_dir))
    except ConfigError as e:
        for path, msg in e.problems:
            print(f"error: {path}: {msg}" if path else f"error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
