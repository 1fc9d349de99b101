"""Start the worker processes of a job: :func:`launch` runs the entry in N processes through
torch's ``elastic_launch`` (the engine inside ``torchrun``; workers forked from
:mod:`paratrain.comm.forkserver`), or in this process under ``torchrun``. After a failure the
agent restarts the group, every rank resumes from its last checkpoint and one line says so
(``worker 1 died (SIGKILL); restarted from step 40``). torch's launcher logging stays off the
console; a worker's exception reaches the caller as a
:class:`~paratrain.comm.worker_errors.WorkerError` (or its ``ConfigError``), the traceback in
``runs/<name>/worker-<rank>.log``; SIGINT/SIGTERM is a ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig
from ..files import newest_checkpoint
from . import worker_errors as W
from .forkserver import ParentState
from .forkserver import context as forkserver_context
from .rendezvous import in_torchrun, launch_config


class _Capture(logging.Handler):
    """Collects torch's launcher log records instead of printing them; keeps the exit
    codes of failed workers (the agent logs ``failed (exitcode: %s) local_rank: %s``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.exits: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if (isinstance(record.msg, str) and record.msg.startswith("failed (exitcode")
                and isinstance(args, tuple) and len(args) >= 2):
            try:
                self.exits[int(str(args[1]))] = int(str(args[0]))
            except (TypeError, ValueError):
                pass


_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[_Capture]:
    """Route torch's launcher loggers to a :class:`_Capture` for the block (with
    ``PARATRAIN_DEBUG`` set they print as usual, and are captured too)."""
    # Loggers are created at import: import the modules a launch uses first.
    for mod in (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.multiprocessing.spawn",
    ):
        importlib.import_module(mod)
    capture = _Capture()
    quiet = not os.environ.get("PARATRAIN_DEBUG")
    saved: list[tuple[logging.Logger, bool]] = []
    for name, obj in list(logging.root.manager.loggerDict.items()):
        if isinstance(obj, logging.Logger) and name.startswith(_TORCH_LOGGERS):
            saved.append((obj, obj.propagate))
            obj.addHandler(capture)
            if quiet:
                obj.propagate = False
    try:
        yield capture
    finally:
        for obj, propagate in saved:
            obj.removeHandler(capture)
            obj.propagate = propagate


@contextlib.contextmanager
def _restore_signal_handlers() -> Iterator[None]:
    """The elastic agent installs SIGINT/SIGTERM/... handlers and never removes them;
    put the previous ones back so Ctrl-C after a launch is a KeyboardInterrupt again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {s: signal.getsignal(s) for n in names if (s := getattr(signal, n, None)) is not None}
    try:
        yield
    finally:
        for s, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError, OSError):
                signal.signal(s, handler)


def _logs_specs(job: JobConfig, log_dir: str, capture: _Capture) -> Any:
    """Torch's per-attempt error files under ``log_dir``; before each restart, the failed
    attempt's tracebacks go to ``worker-<rank>.log`` and one line says what happened."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class _Specs(DefaultLogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=log_dir)
            self.error_files: dict[int, str] = {}
            self.ranks: dict[int, int] = {}
            self.attempt = 0

        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            attempt = int((envs.get(0) or {}).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
            if attempt > 0:
                self.restarted(attempt)
            dest = super().reify(envs)
            self.attempt = attempt
            self.error_files = dict(dest.error_files)
            self.ranks = {local: int(env.get("RANK", local)) for local, env in envs.items()}
            return dest

        def restarted(self, attempt: int) -> None:
            failures = W.attempt_failures(self.error_files, self.ranks, dict(capture.exits))
            capture.exits.clear()
            logs = W.write_failure_logs(job, failures, self.attempt)
            # what the stores resume from: the newest complete checkpoint of any layout
            found = newest_checkpoint(Path(job.run.output_dir) / job.run.name)
            strategy = getattr(job.strategy, "type", None)
            where = found.where_in(strategy) if found is not None else "the start"
            root = W.root_failure(failures)
            if root is not None and root.weight() == 0:
                # A bad job fails the same way on every attempt: stop instead of restarting
                # (this ends the elastic agent's run; the previous workers are stopped).
                W.raise_config_error(root)
            if root is None:
                line = f"a worker on another node failed; restarted from {where}"
            elif root.signal is not None:
                line = f"worker {root.rank} died ({root.signal}); restarted from {where}"
            else:
                first = (root.message.strip().splitlines() or ["failed"])[0]
                line = f"worker {root.rank} failed ({first}); restarted from {where}"
                if root.rank in logs:
                    line += f"; traceback in {logs[root.rank]}"
            print(line, file=sys.stderr, flush=True)

    return _Specs()


def launch(job: JobConfig, *, nprocs: int, entry: Callable[..., Any], target: str | Callable[..., Any],
           resume: bool = False, check_world_size: bool = True) -> Any:
    """Run ``job`` on ``nprocs`` worker processes in all; return global rank 0's result
    (``None`` on a node without rank 0). Every process runs the module-level ``entry(job_json,
    resume, target, parent)`` (``parent``: this process's
    :class:`~paratrain.comm.forkserver.ParentState`, ``None`` under torchrun); ``target`` is
    the worker function or a ``"module:function"`` on this process's ``sys.path``. Under
    torchrun the entry runs here and returns this rank's result; ``check_world_size`` then
    requires ``WORLD_SIZE == nprocs``."""
    job_json = job.to_json_dict()
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if check_world_size and world != nprocs:
            raise ConfigError([("strategy", f"this job needs {nprocs} worker processes but torchrun "
                                             f"started WORLD_SIZE={world}; set --nnodes x "
                                             f"--nproc-per-node to {nprocs}")])
        return entry(job_json, resume, target, None)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(job, nprocs=nprocs)
    if config.rdzv_backend == "c10d" and config.min_nodes > 1:
        # torch's c10d rendezvous shares one store across rounds by default, and node 0's
        # agent never tells a machine that joins a later round (one started again after
        # it was lost) where that store is: it would time out waiting for MASTER_ADDR.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    forkserver_context([entry.__module__])  # the server preloads torch and the entry
    log_dir = tempfile.mkdtemp(prefix="paratrain-launch-")
    try:
        with _quiet_torch_logs() as capture, _restore_signal_handlers():
            specs = _logs_specs(job, log_dir, capture)
            config.logs_specs = specs
            try:
                results = elastic_launch(config, entry)(job_json, resume, target, ParentState())
            except ChildFailedError as e:
                W.reraise_worker_failure(e, job, specs.attempt)
                raise  # unreachable: W.reraise_worker_failure always raises
            except SignalException as e:
                raise KeyboardInterrupt(f"{e.sigval.name} received") from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    if not results:
        return None
    return results.get(0)
