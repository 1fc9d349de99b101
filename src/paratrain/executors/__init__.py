"""How each strategy runs: ``execute(job)`` dispatches on ``job.strategy.type``.

Every executor module exposes ``run(job, *, resume=False, overwrite=False) -> dict``
returning the run summary (the same dict written to ``runs/<name>/summary.json``).
Modules are imported on dispatch so a strategy's dependencies load only when it runs.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from typing import Any

from ..config.job import JobConfig
from ..dispatch import EXECUTORS, executor_module
from .custom import register_coordinator, registered_coordinators

__all__ = ["execute", "executor_module", "register_coordinator", "registered_coordinators", "EXECUTORS"]

def execute(
    job: JobConfig, *, resume: bool = False, overwrite: bool = False, job_dir: Path | None = None
) -> dict[str, Any]:
    """Run ``job`` under its strategy and return the summary. Never falls back to Local.

    A fresh run into a run folder that already holds a run is refused unless
    ``overwrite`` (replace it) or ``resume`` (continue it).

    ``job_dir`` (the job file's folder) anchors relative ``run.imports`` paths.
    Settings the run ignores (:func:`paratrain.config.effective.effective_settings`) are
    warned about once, by the launching process (rank 0 under torchrun)."""
    from ..preflight import preflight

    # Every check before training, the same `paratrain validate` makes (imports the
    # plugins too); errors here come before any worker process is spawned.
    preflight(job, job_dir=job_dir, warn=os.environ.get("RANK", "0") == "0")
    module_name = executor_module(job)
    if os.environ.get("RANK", "0") == "0":
        from ..config.effective import IgnoredSettingWarning, effective_settings

        for item in effective_settings(job, resume=resume).ignored:
            warnings.warn(str(item), IgnoredSettingWarning, stacklevel=2)
    module = importlib.import_module(module_name)
    summary: dict[str, Any] = module.run(job, resume=resume, overwrite=overwrite)
    return summary
