"""Failures of worker processes: :class:`WorkerError`, the ``worker-<rank>.log`` files, and a
failed attempt's root cause from the error files and exit codes (a signal leaves no file):
raised beats killed beats fallout (a closed connection, the agent's SIGTERM), then earliest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig

# Signals the elastic agent itself sends to stop surviving workers: a worker that died
# of one of these is fallout, not a cause.
STOP_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}


class WorkerError(RuntimeError):
    """A worker process failed; ``rank`` and ``message`` name the root cause, ``signal`` the
    signal that killed it (``"SIGKILL"``), ``log`` the ``worker-<rank>.log`` with its traceback."""

    def __init__(self, rank: int, message: str, *, detail: str = "", log: Path | None = None,
                 signal: str | None = None) -> None:
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
    raised) and the exit codes the agent saw (signals leave no error file)."""
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
    """The failure most likely the cause (the agent reports the first process it saw exit,
    often a peer that died of "connection closed" after the real culprit)."""
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


def reraise_worker_failure(err: Exception, job: JobConfig | None = None, attempt: int = 0) -> None:
    files, ranks, exits = _agent_failures(err)
    failures = attempt_failures(files, ranks, exits)
    logs = write_failure_logs(job, failures, attempt) if job is not None else {}
    root = root_failure(failures)
    if root is None:
        raise WorkerError(-1, str(err)) from err
    raise_config_error(root, err)
    sig = root.signal if root.weight() == 1 else None
    raise WorkerError(root.rank, root.message, detail=root.traceback,
                      log=logs.get(root.rank), signal=sig) from err
