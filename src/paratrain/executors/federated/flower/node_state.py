"""A SuperNode's clients' state on its own disk, so a restarted ServerApp resumes it.

A restarted ServerApp is a new ``flwr run`` whose nodes' ``context.state`` starts empty, so a
node given a ``state-dir`` writes its state blob after each round, atomically, as
``<state-dir>/<job name>/<lineage>/partition-<p>-of-<n>/round-<k>.bin`` (entering round
``k``), and an empty context reads the newest file with ``k <=`` the round it needs. The
lineage (drawn with the run folder) keeps a new run of the same name off older files, which
the first save removes. A save keeps the newest file at or below ``keep_from`` (the server's
oldest checkpoint) and every later one, and removes rounds after its own (an abandoned
timeline); a save of an older server ``attempt`` than the folder has seen (a killed server's
message still running) changes nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

from ....files import safe_rmtree, write_bytes, write_text

_FILE = re.compile(r"round-(\d+)\.bin")
_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def _safe(name: str) -> str:
    """``name`` as one path component that stays inside its parent."""
    out = _NAME.sub("_", name)
    return "_" + out if out in ("", ".", "..") else out


class NodeStateFiles:
    """The state files of one node partition of one run lineage (module docstring)."""

    def __init__(self, root: str | Path, job_name: str, lineage: str, partition: int, num_partitions: int) -> None:
        self.root = Path(root)
        self.job_dir = self.root / _safe(job_name)
        self.lineage = _safe(lineage)
        self.dir = self.job_dir / self.lineage / f"partition-{partition}-of-{num_partitions}"

    def _rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _FILE.fullmatch(p.name)))

    def _path(self, k: int) -> Path:
        return self.dir / f"round-{k}.bin"

    def load(self, entering: int) -> bytes | None:
        """The state entering round ``entering``: the newest file at or below it (None: none)."""
        got = [k for k in self._rounds() if k <= entering]
        return self._path(got[-1]).read_bytes() if got else None

    def save(self, entering: int, blob: bytes, keep_from: int, attempt: int = 0) -> None:
        """Write the state entering round ``entering``; prune (module docstring)."""
        if self.job_dir.is_dir():  # an older run of this name: superseded
            for other in self.job_dir.iterdir():
                if other.is_dir() and other.name != self.lineage:
                    safe_rmtree(other, self.job_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        mark = self.dir / "attempt"
        seen = int(mark.read_text()) if mark.exists() else 0
        if attempt < seen:  # a message of a server that was since resumed
            return
        if attempt > seen:
            write_text(mark, str(attempt))
        write_bytes(self._path(entering), blob)
        rounds = self._rounds()
        base = [k for k in rounds if k <= keep_from]
        keep = {k for k in rounds if keep_from < k <= entering} | set(base[-1:])
        for k in rounds:
            if k not in keep:
                self._path(k).unlink(missing_ok=True)
        for p in self.dir.glob(".round-*.tmp"):  # a save killed before its rename
            p.unlink(missing_ok=True)
