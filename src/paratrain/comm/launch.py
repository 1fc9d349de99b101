"""Start the worker processes of a job: :func:`launch` runs the entry in N processes through torch's
``elastic_launch`` (the engine inside ``torchrun``; workers forked from
:mod:`paratrain.comm.forkserver`), or in this process under ``torchrun``. After a failure the agent
restarts the group, every rank resumes from its last checkpoint and one line says so (``worker 1
died (SIGKILL); restarted from step 40``). torch's launcher logging stays off the console; a
worker's exception reaches the caller as a :class:`WorkerError` (or its ``ConfigError``), the
traceback in ``runs/<name>/worker-<rank>.log``; SIGINT/SIGTERM is a ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ..config import ConfigError
from ..config.job import JobConfig
from ..files import newest_checkpoint
from .forkserver import ParentState
from .forkserver import context as forkserver_context
from .rendezvous import cheap_event_names, in_torchrun, launch_config

# Signals the elastic agent itself sends to stop surviving workers: a worker that died
# of one of these is fallout, not a cause.
STOP_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}


class WorkerError(RuntimeError):
    """A worker process failed; ``rank`` and ``message`` name the root cause, ``signal`` the
    signal that killed it (``"SIGKILL"``), ``log`` the ``worker-<rank>.log`` with its traceback."""

    def __init__(self, rank: int, message: str, *, log: Path | None = None,
                 signal: str | None = None) -> None:
        self.rank = rank
        self.message = message
        self.log = log
        self.signal = signal
        super().__init__(f"worker rank {rank} failed: {message}")

    def summary(self) -> str:
        """One line for the user: what happened, on which worker, where the traceback is."""
        if self.signal:
            return f"worker {self.rank} died ({self.signal}); continue with --resume"
        first = (self.message.strip().splitlines() or ["failed"])[0]
        where = f"; traceback in {self.log}" if self.log is not None else ""
        return f"{first} (worker {self.rank}{where})"


def append_worker_log(job: JobConfig, rank: int, text: str) -> Path | None:
    """Append one dated entry to ``<output_dir>/<name>/worker-<rank>.log``; the path, or None
    if unwritable."""
    path = Path(job.run.output_dir) / job.run.name / f"worker-{rank}.log"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(f"=== {stamp} worker {rank} ===\n{text.rstrip()}\n\n")
    except OSError:
        return None
    return path


_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset|DistBackendError|Broken pipe|"
    r"timed out|Signal \d+|SIGTERM|SignalException|To enable traceback",
    re.IGNORECASE,
)
_NO_REPORT = "exited without an error report, code"


@dataclass
class Failure:
    rank: int
    message: str
    traceback: str = ""
    timestamp: int = 0
    signal: str | None = None  # the signal that killed the process, if one did

    def weight(self) -> int:
        """0 = an error the worker raised, 1 = killed from outside (SIGKILL, SIGSEGV, ...),
        2 = fallout of another failure (a closed connection, the agent's SIGTERM)."""
        if self.signal is not None:
            return 2 if self.signal in STOP_SIGNALS else 1
        if self.message.startswith(_NO_REPORT):
            return 1
        return 2 if is_fallout(self.message) else 0


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _read_error_file(path: Path, rank: int) -> Failure | None:
    """Message, traceback and timestamp from an elastic error-file record."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message", "") if isinstance(data, dict) else data
    tb, ts = "", int(data.get("timestamp", 0) or 0) if isinstance(data, dict) else 0
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        tb = str(extra.get("py_callstack", ""))
        ts = int(extra.get("timestamp", ts) or ts)
        msg = msg.get("message", "")
    return Failure(rank, str(msg), tb, ts) if str(msg) else None


def attempt_failures(error_files: dict[int, str], ranks: dict[int, int], exits: dict[int, int]) -> list[Failure]:
    """Every failure of one attempt on this node: the workers' error files (what they
    raised) and the exit codes the agent saw (a signal leaves no error file)."""
    out: dict[int, Failure] = {}
    for local, path in error_files.items():
        rank = ranks.get(local, local)
        found = _read_error_file(Path(path), rank) if path else None
        if found is not None:
            out[rank] = found
    for local, code in exits.items():
        rank = ranks.get(local, local)
        sig = _signal_name(code)
        if rank in out:
            out[rank].signal = out[rank].signal or (sig if sig in STOP_SIGNALS else None)
        elif sig is not None:
            out[rank] = Failure(rank, f"Signal {-code} ({sig}) received", signal=sig,
                                 timestamp=int(time.time()))
        else:
            out[rank] = Failure(rank, f"{_NO_REPORT} {code}", timestamp=int(time.time()))
    return list(out.values())


#: How long a worker that failed only because a peer vanished waits before exiting.
FALLOUT_GRACE_S = 1.0


def is_fallout(message: str) -> bool:
    """True for an error that is the consequence of another failure (a closed connection,
    a peer's reset, a timeout): the worker that raised it is not the cause."""
    return bool(_SECONDARY.search(message))


def root_failure(failures: list[Failure]) -> Failure | None:
    """The failure most likely the cause: raised beats killed beats fallout, then earliest (the
    agent reports the first process it saw exit, often a peer that died of "connection closed"
    after the real culprit)."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.weight(), f.timestamp, f.rank))


def write_failure_logs(job: JobConfig, failures: list[Failure], attempt: int) -> dict[int, Path]:
    logs: dict[int, Path] = {}
    for f in failures:
        if f.weight() == 2 and not f.traceback:
            continue  # stopped by the agent: nothing to say
        if f.signal is not None and not f.traceback:
            text = f"killed by {f.signal} (no traceback: the process did not get to raise)"
        else:
            text = f.traceback or f.message
        path = append_worker_log(job, f.rank, f"attempt {attempt}: {text}")
        if path is not None:
            logs[f.rank] = path
    return logs


def _agent_failures(err: Any) -> tuple[dict[int, str], dict[int, int], dict[int, int]]:
    """(error files, local -> global rank, exit codes) from a ChildFailedError, with the
    sibling error files of the same attempt (``<attempt dir>/<local rank>/error.json``)."""
    files: dict[int, str] = {}
    ranks: dict[int, int] = {}
    exits: dict[int, int] = {}
    for rank, f in dict(getattr(err, "failures", {}) or {}).items():
        local = int(f.local_rank)
        ranks[local] = int(rank)
        exits[local] = int(f.exitcode)
        error_file = getattr(f, "error_file", "")
        if error_file and os.path.isfile(error_file):
            files[local] = error_file
            offset = int(rank) - local
            for other in Path(error_file).parent.parent.glob("*/error.json"):
                try:
                    other_local = int(other.parent.name)
                except ValueError:
                    continue
                files.setdefault(other_local, str(other))
                ranks.setdefault(other_local, offset + other_local)
    return files, ranks, exits


def raise_config_error(root: Failure, err: Exception | None = None) -> None:
    """Re-raise a worker's ConfigError (recorded as ``ConfigError: path: msg`` lines)."""
    prefix = "ConfigError: "
    if root.message.startswith(prefix):
        problems: list[tuple[str, str]] = []
        for line in root.message[len(prefix):].splitlines():
            path, sep, text = line.partition(": ")
            problems.append((path, text) if sep else ("", line))
        raise ConfigError(problems) from err


def reraise_worker_failure(err: Exception, job: JobConfig | None = None, attempt: int = 0) -> NoReturn:
    files, ranks, exits = _agent_failures(err)
    failures = attempt_failures(files, ranks, exits)
    logs = write_failure_logs(job, failures, attempt) if job is not None else {}
    root = root_failure(failures)
    if root is None:
        raise WorkerError(-1, str(err)) from err
    raise_config_error(root, err)
    sig = root.signal if root.weight() == 1 else None
    raise WorkerError(root.rank, root.message, log=logs.get(root.rank), signal=sig) from err


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
            with contextlib.suppress(TypeError, ValueError):
                self.exits[int(str(args[1]))] = int(str(args[0]))


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
    saved = {s: signal.getsignal(s) for n in STOP_SIGNALS if (s := getattr(signal, n, None)) is not None}
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
            failures = attempt_failures(self.error_files, self.ranks, dict(capture.exits))
            capture.exits.clear()
            logs = write_failure_logs(job, failures, self.attempt)
            # what the stores resume from: the newest complete checkpoint of any layout
            found = newest_checkpoint(Path(job.run.output_dir) / job.run.name)
            strategy = getattr(job.strategy, "type", None)
            where = found.where_in(strategy) if found is not None else "the start"
            root = root_failure(failures)
            if root is not None and root.weight() == 0:
                # A bad job fails the same way on every attempt: stop instead of restarting
                # (this ends the elastic agent's run; the previous workers are stopped).
                raise_config_error(root)
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
    """Run ``job`` on ``nprocs`` worker processes in all; return global rank 0's result (``None`` on
    a node without rank 0). Every process runs the module-level ``entry(job_json, resume, target,
    parent)`` (``parent``: this process's :class:`~paratrain.comm.forkserver.ParentState`, ``None``
    under torchrun); ``target`` is the worker function or a ``"module:function"`` on this process's
    ``sys.path``. Under torchrun the entry runs here and returns this rank's result;
    ``check_world_size`` then requires ``WORLD_SIZE == nprocs``."""
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
    cheap_event_names()
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
                reraise_worker_failure(e, job, specs.attempt)
            except SignalException as e:
                raise KeyboardInterrupt(f"{e.sigval.name} received") from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return results.get(0) if results else None
