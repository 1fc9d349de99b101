"""One worker process: ``python -m paratrain.worker JOB [--resume]`` (under torchrun).

It loads the job file and runs it through :func:`paratrain.dispatch.execute`; the
executor's ``launch`` sees torchrun's environment and runs in-process, so the same job file
runs across machines::

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT -m paratrain.worker job.toml

A failure prints one line (``error: field: message`` for a bad job, exit 2; otherwise
``error: Type: message``, exit 1) and writes the traceback to
``runs/<name>/worker-<rank>.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.worker")
    parser.add_argument("job", help="job file (.toml, .json, .yaml)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    args = parser.parse_args(argv)
    from .comm.launch import WorkerError, append_worker_log
    from .config import ConfigError
    from .config.job import load_job
    from .dispatch import execute
    from .training.allocator import keep_freed_memory

    keep_freed_memory()  # a worker process of paratrain's own (training.allocator)
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
        rank = os.environ.get("RANK", "0")
        log = append_worker_log(job, int(rank or 0), traceback.format_exc()) if job is not None else None
        where = f" (worker {rank}; traceback in {log})" if log is not None else ""
        print(f"error: {line}{where}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Without interpreter finalization (comm.process.exit_process: the gloo exit abort).
    from .comm.process import exit_process

    exit_process(main())
