"""One worker process: ``python -m paratrain.worker JOB [--resume]`` (under torchrun).

:func:`worker_entry` is what the elastic launcher runs in every process (it must be a
module-level function so the forkserver can pickle it; :mod:`paratrain.comm.launch` names it
by string, so ``comm`` never imports this module). It imports the job's plugins, joins
the default process group through :func:`paratrain.comm.process.process_group` and calls
the strategy's ``worker_main(ctx, job, resume)``. A restart by the elastic agent
(``TORCHELASTIC_RESTART_COUNT > 0``) resumes from the last checkpoint.

As a command it loads the job file and dispatches it through
:func:`paratrain.dispatch.execute`; the executor's ``launch`` sees torchrun's
environment and runs in-process, so the same job file runs across machines::

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT -m paratrain.worker job.toml

A failure prints one line (``error: field: message`` for a bad job, exit 2; otherwise
``error: Type: message``, exit 1) and writes the traceback to
``runs/<name>/worker-<rank>.log``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from .comm.process import join_process_group, process_group, resolve_device

__all__ = ["worker_entry", "build_context", "resolve_device", "main"]

# Kept under its old name: the WorkerContext of this process, from the environment.
build_context = join_process_group


def _resolve_target(job: Any, target: str | None) -> Any:
    if target is None:
        from .executors import spec_for

        # the executor's spec, not the strategy type's: a Local/DataParallel job with
        # tensor_parallel_size > 1 runs on the tensor-parallel executor.
        fn = spec_for(job).worker
        if fn is None:
            raise TypeError(f"strategy {job.strategy.type} has no multi-process worker")
        return fn
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr or "worker_main")


def worker_entry(
    job_json: dict[str, Any], resume: bool, target: str | None = None, parent: Any = None
) -> Any:
    """Entry point of every worker process (see module docstring). ``parent`` is the
    launching process's :class:`~paratrain.comm.forkserver.ParentState` (a forkserver
    child takes its environment, directory, import path and stdio first); ``None`` under
    torchrun."""
    if parent is not None:
        parent.apply()
    from .config.job import JobConfig

    job = JobConfig.model_validate(job_json)
    if job.run.imports:
        # Plugins (models, datasets, coordinators) must be registered in every process.
        from .executors.custom import import_plugins

        base = os.environ.get("PARATRAIN_JOB_DIR")
        import_plugins(list(job.run.imports), base=Path(base) if base else None)
    try:
        with process_group(job) as ctx:
            from .training.gcfreeze import freeze_startup_objects

            freeze_startup_objects()  # no 100 ms full GC pass inside a step (a straggler rank)
            resume = bool(resume) or ctx.restart_count > 0
            return _resolve_target(job, target)(ctx, job, resume)
    except Exception as e:
        from .comm.worker_errors import FALLOUT_GRACE_S, is_fallout

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


def _write_log(job: Any, text: str) -> Path | None:
    """Append ``text`` to ``runs/<name>/worker-<RANK>.log``; the path, or None."""
    from .comm.worker_errors import append_worker_log

    rank = int(os.environ.get("RANK", "0") or 0)
    return append_worker_log(job, rank, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.worker")
    parser.add_argument("job", help="job file (.toml, .json, .yaml)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    args = parser.parse_args(argv)
    from .comm.worker_errors import WorkerError
    from .config import ConfigError
    from .config.job import load_job
    from .dispatch import execute

    job = None
    try:
        job = load_job(args.job)
        job_dir = os.path.dirname(os.path.abspath(args.job))
        os.environ.setdefault("PARATRAIN_JOB_DIR", job_dir)
        execute(job, resume=args.resume, job_dir=Path(job_dir))
    except ConfigError as e:
        for path, msg in e.problems:
            print(f"error: {path}: {msg}" if path else f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line here, the traceback in the log
        if os.environ.get("PARATRAIN_DEBUG"):
            raise
        if isinstance(e, WorkerError):
            print(f"error: {e.summary()}", file=sys.stderr)
            return 1
        line = f"{type(e).__name__}: {e}".splitlines()[0]
        log = _write_log(job, traceback.format_exc()) if job is not None else None
        rank = os.environ.get("RANK", "0")
        where = f" (worker {rank}; traceback in {log})" if log is not None else ""
        print(f"error: {line}{where}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
