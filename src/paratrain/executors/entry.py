"""What every launched worker process runs: :func:`worker_entry`, which the executors hand
to :func:`paratrain.comm.launch.launch` with their worker function (so ``comm`` imports no
floor above it). Module-level: the forkserver pickles it by reference.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..comm.process import process_group


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``target`` itself, or the function a ``"module:function"`` string names (a test's
    worker module on the parent's ``sys.path``, importable once the parent's state is
    applied)."""
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    return fn


def worker_entry(
    job_json: dict[str, Any], resume: bool, target: str | Callable[..., Any], parent: Any = None
) -> Any:
    """Import the job's plugins, join the process group and call ``target(ctx, job, resume)``;
    a restart by the elastic agent resumes. ``parent``: the launching process's
    :class:`~paratrain.comm.forkserver.ParentState` (``None`` under torchrun)."""
    if parent is not None:
        parent.apply()
    from ..config.job import JobConfig

    job = JobConfig.model_validate(job_json)
    if job.run.imports:
        # Plugins (models, datasets, coordinators) must be registered in every process.
        from .plugins import import_plugins

        base = os.environ.get("PARATRAIN_JOB_DIR")
        import_plugins(list(job.run.imports), base=Path(base) if base else None)
    try:
        with process_group(job) as ctx:
            from ..training.gcfreeze import freeze_startup_objects
            from ..training.threads import intra_op_threads

            if ctx.device.type == "cpu":  # training.threads: the host's cores, shared
                torch.set_num_threads(intra_op_threads(job))
            from ..training.allocator import keep_freed_memory

            keep_freed_memory()  # a worker trains and exits: freed buffers are reused
            if ctx.is_main:  # rank 0 draws report.png: its matplotlib off the end of the run
                from ..training.report import import_in_background

                import_in_background()

            freeze_startup_objects()  # no 100 ms full GC pass inside a step (a straggler rank)
            resume = bool(resume) or ctx.restart_count > 0
            return _resolve(target)(ctx, job, resume)
    except Exception as e:
        from ..comm.launch import FALLOUT_GRACE_S, is_fallout

        if parent is not None and is_fallout(str(e)):
            # A collective failed because a peer vanished (SIGKILL, OOM): the agent reports
            # only the first process it sees exit, so give the dead peer's exit time to be
            # seen first and named as the cause (forkserver children are reaped by the
            # server, a few ms later than this process's own exit would be).
            time.sleep(FALLOUT_GRACE_S)
        raise
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal's group; the launcher then stops
        # the workers with the same signal. One interrupt is enough: a second one would
        # land in the interpreter's exit handlers and print their traceback.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
