"""One worker process: ``python -m paratrain.worker JOB [--resume]`` (under torchrun).

It loads the job file and runs it through :func:`paratrain.dispatch.execute`; the
executor's ``launch`` sees torchrun's environment and runs in-process, so the same job file
runs across machines::

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT -m paratrain.worker job.toml

A failure prints one line (``error: field: message`` per problem of a bad job, exit 2;
``interrupted; continue with --resume``, 130; otherwise ``error: Type: message``, exit 1,
``PARATRAIN_DEBUG=1`` raising it instead) and writes the traceback to
``runs/<name>/worker-<rank>.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ConfigError


def usage(err: ConfigError, prefix: str) -> int:
    """Each problem of ``err`` as one ``prefix field: message`` line on stderr; exit 2."""
    for field, msg in err.problems:
        print(f"{prefix}{field}: {msg}" if field else f"{prefix}{msg}", file=sys.stderr)
    return 2


def failed(e: BaseException, prefix: str, where: Callable[[], str] | None = None) -> int:
    """The exit code of a run (``paratrain run`` too) that raised ``e``, its reason on stderr
    (module docstring); ``where()``: where the traceback went (else: how to see it)."""
    from .comm.launch import WorkerError
    from .config import ConfigError

    if isinstance(e, ConfigError):
        return usage(e, prefix)
    if isinstance(e, KeyboardInterrupt):
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130
    if os.environ.get("PARATRAIN_DEBUG"):
        raise e
    if isinstance(e, WorkerError):  # its traceback is in runs/<name>/worker-<rank>.log
        print(f"error: {e.summary()}", file=sys.stderr)
        return 1
    line = f"{type(e).__name__}: {e}".splitlines()[0]
    print(f"error: {line}{where() if where is not None else ''}", file=sys.stderr)
    if where is None:
        print("(set PARATRAIN_DEBUG=1 for the traceback)", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.worker")
    parser.add_argument("job", help="job file (.toml, .json, .yaml)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    args = parser.parse_args(argv)
    from .comm.launch import append_worker_log
    from .config.job import load_job
    from .dispatch import execute
    from .training.allocator import keep_freed_memory

    keep_freed_memory()  # a worker process of paratrain's own (training.allocator)
    job = None

    def logged() -> str:  # one line on stderr, the traceback in the worker's log
        rank = os.environ.get("RANK", "0")
        log = append_worker_log(job, int(rank or 0), traceback.format_exc()) if job is not None else None
        return f" (worker {rank}; traceback in {log})" if log is not None else ""

    try:
        job = load_job(args.job)
        job_dir = os.path.dirname(os.path.abspath(args.job))
        os.environ.setdefault("PARATRAIN_JOB_DIR", job_dir)
        execute(job, resume=args.resume, job_dir=Path(job_dir))
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - one line, not a traceback
        return failed(e, "error: ", logged)
    return 0


if __name__ == "__main__":
    # One job a process, as the paratrain command: the collector paused until the run
    # trains (training.gcfreeze); without interpreter finalization (comm.process.exit_process:
    # the gloo exit abort).
    from .training.gcfreeze import own_process

    own_process(pause=True)  # before comm.process imports torch
    from .comm.process import exit_process

    exit_process(main())
