"""Start the worker processes of a job: torch's elastic launcher, or torchrun's environment.

``launch(job, nprocs=N)`` runs ``paratrain.worker:worker_entry`` in N processes through
:func:`torch.distributed.launcher.api.elastic_launch` (the engine inside ``torchrun``):
a c10d rendezvous on ``127.0.0.1`` (port 0: the store binds a port the kernel picks, so
no other process can take it first), ``nproc_per_node=N``,
``max_restarts=job.run.max_restarts``, ``start_method="spawn"``. Every process joins
the default process group (:mod:`paratrain.comm.process`), builds a
:class:`~paratrain.comm.context.WorkerContext` and calls the strategy's
``worker_main(ctx, job, resume)``. After a worker failure the elastic agent restarts the
whole group; ``TORCHELASTIC_RESTART_COUNT > 0`` makes every rank resume from its last
checkpoint, and one line says so (``worker 1 died (SIGKILL); restarted from step 40``).

Multi-node: ``PARATRAIN_NNODES``, ``PARATRAIN_NODE_RANK`` and ``PARATRAIN_RDZV_ENDPOINT``
(set by ``paratrain run --nnodes/--node-rank/--rdzv-endpoint``, checked by
:func:`check_nodes`, whose errors name those flags) configure the rendezvous the way
``torchrun`` does: with a node rank the ``static`` backend (node rank fixed, the endpoint
is the master address), without one the ``c10d`` backend on the endpoint.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` already set) nothing is
launched: the entry runs in this process.

Errors: torch's own launcher logging (tracebacks of failed workers, "terminating
process" notices) is kept off the console. A worker's exception reaches the caller as
:class:`WorkerError` carrying the root-cause rank and message, with the traceback in
``runs/<name>/worker-<rank>.log`` (a :class:`~paratrain.config.ConfigError` raised in a
worker is re-raised as a ``ConfigError`` with the same problems); SIGINT/SIGTERM during
a launch is a ``KeyboardInterrupt``.
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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig

__all__ = [
    "WorkerError",
    "launch",
    "in_torchrun",
    "launch_config",
    "check_nodes",
    "append_worker_log",
    "worker_log_path",
    "ENV_NNODES",
    "ENV_NODE_RANK",
    "ENV_RDZV_ENDPOINT",
    "ENTRY",
]

ENV_NNODES = "PARATRAIN_NNODES"
ENV_NODE_RANK = "PARATRAIN_NODE_RANK"
ENV_RDZV_ENDPOINT = "PARATRAIN_RDZV_ENDPOINT"
# The command-line flag behind each variable: errors name what the user typed.
_FLAG = {ENV_NNODES: "--nnodes", ENV_NODE_RANK: "--node-rank", ENV_RDZV_ENDPOINT: "--rdzv-endpoint"}

# The function every worker process runs, named by string: comm does not import the
# layers above it (paratrain.worker imports the executors).
ENTRY = "paratrain.worker:worker_entry"

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
# Signals the elastic agent itself sends to stop surviving workers: a worker that died
# of one of these is fallout, not a cause.
_STOP_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}


class WorkerError(RuntimeError):
    """A worker process failed; ``rank`` and ``message`` name the root cause.

    ``signal`` is the signal that killed it (``"SIGKILL"``), if any; ``log`` the
    ``worker-<rank>.log`` holding its traceback, if one was written.
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        detail: str = "",
        log: Path | None = None,
        signal: str | None = None,
    ) -> None:
        self.rank = rank
        self.message = message
        self.detail = detail
        self.log = log
        self.signal = signal
        super().__init__(f"worker rank {rank} failed: {message}")

    def summary(self) -> str:
        """One line for the user: what happened, on which worker, where the traceback is."""
        if self.signal:
            text = f"worker {self.rank} died ({self.signal}); continue with --resume"
        else:
            first = (self.message.strip().splitlines() or ["failed"])[0]
            text = f"{first} (worker {self.rank}"
            text += f"; traceback in {self.log})" if self.log is not None else ")"
        return text


def in_torchrun() -> bool:
    """True when torchrun (or any launcher) already set RANK, WORLD_SIZE and MASTER_ADDR."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


# ------------------------------------------------------------------ multi-node options


def _int_env(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError([(_FLAG[name], f"must be an integer (got {raw!r})")]) from None


def check_nodes(nnodes: int | None, node_rank: int | None, endpoint: str | None) -> None:
    """Check ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint``; a ConfigError names the flag."""
    n = 1 if nnodes is None else nnodes
    if n < 1:
        raise ConfigError([("--nnodes", f"must be >= 1 (got {n})")])
    if n > 1 and not endpoint:
        raise ConfigError([("--rdzv-endpoint", "required with more than one node (HOST:PORT)")])
    if node_rank is not None and not 0 <= node_rank < n:
        raise ConfigError([("--node-rank", f"must be in [0, {n}) with --nnodes {n} (got {node_rank})")])
    if endpoint:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError([("--rdzv-endpoint", f"expected HOST:PORT with a port in 1..65535 (got {endpoint!r})")])


def launch_config(job: JobConfig, *, nprocs: int) -> Any:
    """The :class:`LaunchConfig` for ``job`` on this node (reads the PARATRAIN_* env vars).

    ``nprocs`` is the whole job's process count; each of the ``PARATRAIN_NNODES`` nodes
    runs ``nprocs / nnodes`` of them.
    """
    from torch.distributed.launcher.api import LaunchConfig

    if nprocs < 1:
        raise ConfigError([("nprocs", f"need at least one worker process (got {nprocs})")])
    nnodes = _int_env(ENV_NNODES, 1) or 1
    node_rank = _int_env(ENV_NODE_RANK, None)
    endpoint = os.environ.get(ENV_RDZV_ENDPOINT, "")
    check_nodes(nnodes, node_rank, endpoint)
    if nprocs % nnodes:
        raise ConfigError([(
            "--nnodes",
            f"the job needs {nprocs} worker processes, which {nnodes} nodes cannot share evenly",
        )])

    rdzv_configs: dict[str, Any] = {"timeout": int(job.comm.timeout_s)}
    local_addr: str | None = None
    if nnodes == 1 and not endpoint:
        # Port 0: the rendezvous store binds a port the kernel picks, atomically (what
        # torchrun --standalone does). A port picked beforehand (bind, close, bind
        # again) can be taken by any other socket in between.
        endpoint = "127.0.0.1:0"
        backend = "c10d"
        local_addr = "127.0.0.1"
        rdzv_configs["is_host"] = True
    elif node_rank is not None:
        # torchrun's --node-rank semantics: the static rendezvous fixes node ranks and
        # the endpoint is the master's address.
        backend = "static"
        rdzv_configs["rank"] = node_rank
    else:
        backend = "c10d"
    run_id = os.environ.get("PARATRAIN_RUN_ID") or f"{job.run.name}-{uuid.uuid4().hex[:8]}"
    if nnodes > 1:
        # Every node must agree on the run id; derive it from the job, not a random value.
        run_id = os.environ.get("PARATRAIN_RUN_ID") or f"paratrain-{job.run.name}"
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nprocs // nnodes,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=job.run.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
    )


# ------------------------------------------------------------------ worker logs


def worker_log_path(job: JobConfig, rank: int) -> Path:
    """``<output_dir>/<name>/worker-<rank>.log``."""
    return Path(job.run.output_dir) / job.run.name / f"worker-{rank}.log"


def append_worker_log(job: JobConfig, rank: int, text: str) -> Path | None:
    """Append one dated entry to worker ``rank``'s log; the path, or None if unwritable."""
    path = worker_log_path(job, rank)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(f"=== {stamp} worker {rank} ===\n{text.rstrip()}\n\n")
    except OSError:
        return None
    return path


# ------------------------------------------------------------------ failures


_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset|DistBackendError|Broken pipe|"
    r"timed out|Signal \d+|SIGTERM|SignalException|To enable traceback",
    re.IGNORECASE,
)


_NO_REPORT = "exited without an error report, code"


@dataclass
class _Failure:
    rank: int
    message: str
    traceback: str = ""
    timestamp: int = 0
    signal: str | None = None  # the signal that killed the process, if one did

    def weight(self) -> int:
        """0 = an error the worker raised, 1 = killed from outside (SIGKILL, SIGSEGV, ...),
        2 = fallout of another failure (a closed connection, the agent's SIGTERM)."""
        if self.signal is not None:
            return 2 if self.signal in _STOP_SIGNALS else 1
        if self.message.startswith(_NO_REPORT):
            return 1
        return 2 if _SECONDARY.search(self.message) else 0


def _message(data: Any) -> tuple[str, str, int]:
    """(message, traceback, timestamp) from an elastic error-file record."""
    msg = data.get("message", "") if isinstance(data, dict) else data
    tb = ""
    ts = int(data.get("timestamp", 0) or 0) if isinstance(data, dict) else 0
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        tb = str(extra.get("py_callstack", ""))
        ts = int(extra.get("timestamp", ts) or ts)
        msg = msg.get("message", "")
    return str(msg), tb, ts


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _read_error_file(path: Path, rank: int) -> _Failure | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg, tb, ts = _message(data)
    return _Failure(rank, msg, tb, ts) if msg else None


def _attempt_failures(
    error_files: dict[int, str], ranks: dict[int, int], exits: dict[int, int]
) -> list[_Failure]:
    """Every failure of one attempt on this node: the workers' error files (what they
    raised) and the exit codes the agent saw (signals leave no error file)."""
    out: dict[int, _Failure] = {}
    for local, path in error_files.items():
        rank = ranks.get(local, local)
        found = _read_error_file(Path(path), rank) if path else None
        if found is not None:
            out[rank] = found
    for local, code in exits.items():
        rank = ranks.get(local, local)
        sig = _signal_name(code)
        if rank in out:
            out[rank].signal = out[rank].signal or (sig if sig in _STOP_SIGNALS else None)
        elif sig is not None:
            out[rank] = _Failure(rank, f"Signal {-code} ({sig}) received", signal=sig,
                                 timestamp=int(time.time()))
        else:
            out[rank] = _Failure(rank, f"{_NO_REPORT} {code}", timestamp=int(time.time()))
    return list(out.values())


def _root(failures: list[_Failure]) -> _Failure | None:
    """The failure most likely to be the cause: raised beats killed beats fallout, then
    the earliest. (The agent reports the first process it saw exit, which is often a
    peer that died of "connection closed" after the real culprit.)"""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.weight(), f.timestamp, f.rank))


def _failure_log_text(f: _Failure, attempt: int) -> str:
    head = f"attempt {attempt}: "
    if f.signal is not None and not f.traceback:
        return head + f"killed by {f.signal} (no traceback: the process did not get to raise)"
    return head + (f.traceback or f.message)


def _write_logs(job: JobConfig, failures: list[_Failure], attempt: int) -> dict[int, Path]:
    logs: dict[int, Path] = {}
    for f in failures:
        if f.weight() == 2 and not f.traceback:
            continue  # stopped by the agent: nothing to say
        path = append_worker_log(job, f.rank, _failure_log_text(f, attempt))
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


def _root_cause(err: Any) -> tuple[int, str, str]:
    """(rank, message, traceback) of the failure most likely to be the cause."""
    files, ranks, exits = _agent_failures(err)
    root = _root(_attempt_failures(files, ranks, exits))
    if root is None:
        return -1, str(err), ""
    return root.rank, root.message, root.traceback


def _raise_config_error(root: _Failure, err: Exception | None = None) -> None:
    """Re-raise a worker's ConfigError (recorded as ``ConfigError: path: msg`` lines)."""
    prefix = "ConfigError: "
    if root.message.startswith(prefix):
        problems: list[tuple[str, str]] = []
        for line in root.message[len(prefix):].splitlines():
            path, sep, text = line.partition(": ")
            problems.append((path, text) if sep else ("", line))
        raise ConfigError(problems) from err


def _reraise(err: Exception, job: JobConfig | None = None, attempt: int = 0) -> None:
    files, ranks, exits = _agent_failures(err)
    failures = _attempt_failures(files, ranks, exits)
    logs = _write_logs(job, failures, attempt) if job is not None else {}
    root = _root(failures)
    if root is None:
        raise WorkerError(-1, str(err)) from err
    _raise_config_error(root, err)
    sig = root.signal if root.weight() == 1 else None
    raise WorkerError(root.rank, root.message, detail=root.traceback,
                      log=logs.get(root.rank), signal=sig) from err


# ------------------------------------------------------------------ restarts and logging


def _resume_point(run_dir: Path) -> int | None:
    """The step a restarted group resumes from, as the executors find it: a
    ``*-complete.json`` marker, else the newest top-level ``ckpt-<step>.pt``, else the
    newest step every per-rank checkpoint folder holds."""
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return None
    for marker in sorted(ckpts.glob("*-complete.json")):
        try:
            return int(json.loads(marker.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    pattern = re.compile(r"^ckpt-(\d+)\.pt$")
    by_dir: dict[Path, list[int]] = {}
    for p in ckpts.rglob("ckpt-*.pt"):
        m = pattern.match(p.name)
        if m:
            by_dir.setdefault(p.parent, []).append(int(m.group(1)))
    if ckpts in by_dir:
        return max(by_dir[ckpts])
    if not by_dir:
        return None
    return min(max(steps) for steps in by_dir.values())


class _Capture(logging.Handler):
    """Collects torch's launcher log records instead of printing them; keeps the exit
    codes of failed workers (the agent logs ``failed (exitcode: %s) local_rank: %s``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.exits: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if (
            isinstance(record.msg, str)
            and record.msg.startswith("failed (exitcode")
            and isinstance(args, tuple)
            and len(args) >= 2
        ):
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
    """Torch's default per-attempt layout under ``log_dir`` (error files only; output
    stays on the console), plus: before each restart, write the failed attempt's
    tracebacks to ``worker-<rank>.log`` and print one line saying what happened."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class _Specs(DefaultLogsSpecs):  # type: ignore[misc]
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
            self.ranks = {
                local: int(env.get("RANK", local)) for local, env in envs.items()
            }
            return dest

        def restarted(self, attempt: int) -> None:
            failures = _attempt_failures(self.error_files, self.ranks, dict(capture.exits))
            capture.exits.clear()
            logs = _write_logs(job, failures, self.attempt)
            step = _resume_point(Path(job.run.output_dir) / job.run.name)
            where = f"step {step}" if step is not None else "the start"
            root = _root(failures)
            if root is not None and root.weight() == 0:
                # A bad job fails the same way on every attempt: stop instead of restarting
                # (this ends the elastic agent's run; the previous workers are stopped).
                _raise_config_error(root)
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


def launch(
    job: JobConfig,
    *,
    nprocs: int,
    resume: bool = False,
    target: str | None = None,
    check_world_size: bool = True,
) -> Any:
    """Run ``job`` on ``nprocs`` worker processes in all; return global rank 0's result
    (``None`` on a node that does not host rank 0).

    ``target`` ("module:function") overrides the strategy's ``worker_main`` (tests, or an
    executor with several worker roles). Under torchrun the entry runs in this process and
    the returned value is this rank's result; ``check_world_size`` then requires
    ``WORLD_SIZE == nprocs`` (an error otherwise).
    """
    module_name, _, attr = ENTRY.partition(":")
    entry = getattr(importlib.import_module(module_name), attr)

    job_json = job.to_json_dict()
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if check_world_size and world != nprocs:
            raise ConfigError(
                [
                    (
                        "strategy",
                        f"this job needs {nprocs} worker processes but torchrun started "
                        f"WORLD_SIZE={world}; set --nnodes x --nproc-per-node to {nprocs}",
                    )
                ]
            )
        return entry(job_json, resume, target)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(job, nprocs=nprocs)
    log_dir = tempfile.mkdtemp(prefix="paratrain-launch-")
    try:
        with _quiet_torch_logs() as capture, _restore_signal_handlers():
            specs = _logs_specs(job, log_dir, capture)
            config.logs_specs = specs
            try:
                results = elastic_launch(config, entry)(job_json, resume, target)
            except ChildFailedError as e:
                _reraise(e, job, specs.attempt)
                raise  # unreachable: _reraise always raises
            except SignalException as e:
                raise KeyboardInterrupt(f"{e.sigval.name} received") from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    if not results:
        return None
    return results.get(0)
