"""The run folder ``<output_dir>/<name>/``: job.json, metrics.jsonl, checkpoints/, summary.json.

The folder is ``output_dir / name`` (one component), every deletion goes through
:func:`safe_rmtree`, a folder that holds a run needs ``overwrite``, and the launching
process holds ``fcntl.flock`` on ``<run>/.lock`` (workers see it via :data:`HELD_ENV`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..files import inside as _inside
from ..files import safe_rmtree, write_text

if TYPE_CHECKING:  # the config (pydantic) is imported where an error is raised: a process
    # that only reads metrics (report.png's drawer) does not load it
    from ..config import ConfigError
    from ..config.job import JobConfig

LOCK_NAME = ".lock"
# the run folders claimed by this process or the one that launched it (os.pathsep-separated)
HELD_ENV = "PARATRAIN_HELD_RUN_DIRS"
_NOT_RESULTS = {LOCK_NAME, "job.json"}  # written before training: they do not make a run
_WORKER_LOG = re.compile(r"^worker-\d+\.log$")

# resolved run folder -> [lock fd, claim count] for the claims this process holds
_HELD: dict[str, list[int]] = {}


def _config_error(problems: list[tuple[str, str]]) -> ConfigError:
    from ..config import ConfigError

    return ConfigError(problems)


def disk_error(path: str | Path, err: OSError, what: str = "write") -> ConfigError:
    """A ConfigError naming ``path`` for a failed filesystem operation."""
    reason = err.strerror or type(err).__name__
    return _config_error([("run.output_dir", f"cannot {what} {path}: {reason}")])


def run_dir_of(job: JobConfig) -> Path:
    """``output_dir / name``; a ConfigError if that is not a folder inside output_dir."""
    name, root = job.run.name, Path(job.run.output_dir)
    d = root / name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise _config_error([("run.name", f"must be one folder name inside run.output_dir (no "
                                          f"'/', '\\', '..', not empty; got {name!r})")])
    if not _inside(d, root):
        raise _config_error([("run.name", f"the run folder {d} is not inside run.output_dir {root}")])
    return d


def holds_run(d: str | Path) -> bool:
    """True when folder ``d`` holds a file other than the lock, job.json and
    ``worker-<rank>.log`` at its top: an attempt that produced nothing can simply be re-run."""
    d = Path(d)
    if not d.is_dir():
        return False
    for dirpath, _dirs, files in os.walk(d):
        top = Path(dirpath) == d
        if any(not (top and (f in _NOT_RESULTS or _WORKER_LOG.match(f))) for f in files):
            return True
    return False


def _drop_inherited_locks() -> None:
    """In a forked child: close the inherited lock fds (a ``flock`` belongs to the open file)."""
    for fd, _count in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _held_env() -> list[str]:
    return [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p]


def _is_held(d: Path) -> bool:
    key = str(d.resolve())
    return key in _HELD or key in _held_env()


def _owns_run_folder() -> bool:
    """Whether this process claims the run folder: torchrun's rank 0, or node 0 without torchrun."""
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return os.environ["RANK"] == "0"
    return os.environ.get("PARATRAIN_NODE_RANK", "0") in ("", "0")


def _restarted() -> bool:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    except ValueError:
        return False


def _lock_holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return text.split()[0] if text else "unknown"


def _acquire(d: Path) -> None:
    key = str(d.resolve())
    if key in _HELD:  # re-entrant within one process (a coordinator running sub-runs)
        _HELD[key][1] += 1
        return
    lock = d / LOCK_NAME
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise disk_error(lock if d.is_dir() else d, e, "create") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise _config_error([("run.name", (
            f"run folder {d} is in use by another paratrain run (pid {_lock_holder(lock)}); "
            "wait for it to finish or choose another run.name"))]) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as e:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise disk_error(lock, e) from None
    _HELD[key] = [fd, 1]
    os.environ[HELD_ENV] = os.pathsep.join([*_held_env(), key])


def _release(d: Path) -> None:
    key = str(d.resolve())
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _HELD[key]
    os.environ[HELD_ENV] = os.pathsep.join(p for p in _held_env() if p != key)
    if not os.environ[HELD_ENV]:
        del os.environ[HELD_ENV]
    try:
        fcntl.flock(entry[0], fcntl.LOCK_UN)
    finally:
        os.close(entry[0])


def _refuse_message(d: Path) -> str:
    return (f"run folder {d} already holds a run; pass --overwrite (overwrite=True) to "
            "replace it or --resume (resume=True) to continue it")


# the one loop's strategies: each resumes the others' checkpoints (.reshard)
_RESHARDABLE = frozenset({"Local", "DataParallel", "ModelParallel"})


def _check_resumable(d: Path, job: JobConfig) -> None:
    """On resume: the folder's job.json names the same strategy type (or two of :data:`_RESHARDABLE`)."""
    try:
        old = json.loads((d / "job.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # nothing to compare with: the checkpoint's check decides
        logging.getLogger(__name__).debug("%s: no readable job.json to compare: %r", d, e)
        return
    old_type = (old.get("strategy") or {}).get("type") if isinstance(old, dict) else None
    new_type = getattr(job.strategy, "type", None)
    if old_type is not None and old_type != new_type and not {old_type, new_type} <= _RESHARDABLE:
        raise _config_error([("strategy.type", (
            f"run folder {d} holds a {old_type} run; this job's strategy is {new_type}: "
            "resume with the original strategy, or start a fresh run with --overwrite"))])


def _clear(d: Path, root: Path) -> None:
    if not d.is_dir():
        return
    for child in d.iterdir():
        if child.name != LOCK_NAME:
            safe_rmtree(child, root)


def _make(d: Path, job: JobConfig) -> None:
    try:
        (d / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise disk_error(d / "checkpoints", e, "create") from None
    _atomic_write(d / "job.json", json.dumps(job.to_json_dict(), indent=2))


class RunFolder:
    """The launching process's claim on ``runs/<name>/`` (a context manager).

    ``__enter__`` takes the lock and checks the rules (a fresh run into a folder that holds
    a run needs ``overwrite``; ``resume`` the same strategy type); nothing else is written
    yet, so a caller can still check a checkpoint. :meth:`prepare` then clears (fresh runs),
    creates and writes job.json. Under torchrun only rank 0 claims.
    """

    def __init__(self, job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> None:
        self.job = job
        self.path = run_dir_of(job)
        self.resume = bool(resume) or _restarted()
        self.overwrite = bool(overwrite)
        self.owner = _owns_run_folder()
        self._entered = False

    def __enter__(self) -> RunFolder:
        if not self.owner:
            return self
        _acquire(self.path)
        self._entered = True
        try:
            if self.resume:
                _check_resumable(self.path, self.job)
            elif not self.overwrite and holds_run(self.path):
                raise _config_error([("run.name", _refuse_message(self.path))])
        except BaseException:
            self._entered = False
            _release(self.path)
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._entered:
            self._entered = False
            _release(self.path)

    def prepare(self) -> Path:
        """Clear (fresh run), create the folder and write job.json (on resume: once checked)."""
        if self.owner:
            if not self.resume:
                _clear(self.path, Path(self.job.run.output_dir))
            _make(self.path, self.job)
        return self.path

    def prepare_launch(self) -> Path:
        """Before a launcher starts workers: a fresh run is prepared now; a resume is left to
        the workers, whose :func:`prepare_run_dir` writes job.json once their check passed."""
        return self.path if self.resume else self.prepare()


def prepare_run_dir(job: JobConfig, *, resume: bool, overwrite: bool = False) -> Path:
    """Create the run folder and write job.json (a worker or an in-process runner; on resume
    only after the checkpoint was checked). Unclaimed (no :class:`RunFolder`), a fresh run
    into a folder that holds a run is refused unless ``overwrite``, as a claim would."""
    d = run_dir_of(job)
    if not _is_held(d) and not resume:
        if holds_run(d) and not overwrite:
            raise _config_error([("run.name", _refuse_message(d))])
        _clear(d, Path(job.run.output_dir))
    _make(d, job)
    return d


def _atomic_write(path: Path, text: str) -> None:
    """:func:`paratrain.files.write_text`, a failure said as a disk error naming the file."""
    try:
        write_text(path, text)
    except OSError as e:
        raise disk_error(path, e) from None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    """Appends one JSON record per line to ``metrics.jsonl``, each also to the run's trackers."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._trackers: Any = None  # loggers.Trackers, or False when the job lists none
        self._resume_after: float | None = None

    def log(self, record: dict[str, Any]) -> None:
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        except OSError as e:
            raise disk_error(self.path, e) from None
        trackers = self._fanout()
        if trackers:
            trackers.log(record)

    def close(self) -> None:
        """The trackers' runs are written and closed (a later record opens them again)."""
        if self._trackers:
            self._trackers.close()

    def _fanout(self) -> Any:
        if self._trackers is None:
            job = self.path.parent / "job.json"
            names = (json.loads(job.read_text(encoding="utf-8")).get("run", {}).get("loggers")
                     if job.exists() else None)
            self._trackers = False
            if names:
                import atexit

                from .loggers import Trackers

                self._trackers = Trackers(self.path.parent, list(names),
                                          lambda: read_metrics(self.path.parent, train=True),
                                          self._resume_after)
                atexit.register(self.close)  # an interrupted run's trackers are written too
        return self._trackers

    def truncate_after(self, key: str, value: float) -> None:
        """Keep the records with ``key <= value`` (a resume point), without a torn last line a
        killed run left (warned); the trackers continue after ``value``."""
        self._resume_after = value
        if self._trackers:
            self._trackers.resume_after = value
        if not self.path.exists():
            return
        records, torn = _parse_metrics(self.path)
        if torn is not None:
            warnings.warn(f"{self.path}: dropping its torn last line {torn} (a write cut short "
                          "when the run stopped)", RuntimeWarning, stacklevel=2)
        kept = [r for r in records if r.get(key, -math.inf) <= value]
        _atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))


def _parse_metrics(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """The records of ``path`` and the number of a torn last line (None: none; a killed run's
    partial line, redone on resume). A bad line before the last is a ConfigError."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise disk_error(path, e, "read") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    out: list[dict[str, Any]] = []
    for i, (n, line) in enumerate(lines):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError(f"a JSON {type(rec).__name__}, not a record")
        except ValueError as e:
            if i == len(lines) - 1:
                return out, n
            raise _config_error([("metrics", (
                f"{path} line {n} is not a JSON record ({e}); repair or delete that line, or "
                "start a fresh run with --overwrite"))]) from None
        out.append(rec)
    return out, None


def read_metrics(run_dir: str | Path, *, train: bool = False) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` ([] when absent; a torn last line left
    out); the training curve's (``"kind": "train"``, :mod:`.loop`) only with ``train=True``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = _parse_metrics(path)[0]
    return records if train else [r for r in records if r.get("kind") != "train"]


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    _atomic_write(Path(run_dir) / "summary.json", json.dumps(summary, indent=2, default=str))
