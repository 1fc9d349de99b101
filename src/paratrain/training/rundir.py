"""The run folder ``<output_dir>/<name>/``: job.json, metrics.jsonl, checkpoints/, summary.json."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from ..config.job import JobConfig

__all__ = ["run_dir_of", "prepare_run_dir", "MetricsWriter", "read_metrics", "write_summary"]


def run_dir_of(job: JobConfig) -> Path:
    return Path(job.run.output_dir) / job.run.name


def prepare_run_dir(job: JobConfig, *, resume: bool, clean: bool = True) -> Path:
    """Create the run folder and write job.json. A fresh (non-resume) run clears
    an old folder of the same name so stale checkpoints are never picked up."""
    d = run_dir_of(job)
    if not resume and clean and d.exists():
        shutil.rmtree(d)
    (d / "checkpoints").mkdir(parents=True, exist_ok=True)
    _atomic_write(d / "job.json", json.dumps(job.to_json_dict(), indent=2))
    return d


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    """Appends one JSON record per line to ``metrics.jsonl``.

    ``truncate_after(key, value)`` drops records past a resume point so a resumed run's
    file reads as if it had never stopped.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"

    def log(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def truncate_after(self, key: str, value: float) -> None:
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path.parent) if r.get(key, -math.inf) <= value]
        _atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    _atomic_write(Path(run_dir) / "summary.json", json.dumps(summary, indent=2, default=str))
