"""How each strategy runs: ``execute(job)`` dispatches on ``job.strategy.type``.

Every executor module exposes ``run(job, *, resume=False) -> dict`` returning the run
summary (the same dict written to ``runs/<name>/summary.json``). Modules are imported
on dispatch so a strategy's dependencies load only when it runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig
from .custom import register_coordinator, registered_coordinators

__all__ = ["execute", "register_coordinator", "registered_coordinators", "EXECUTORS"]

# strategy "type" -> module implementing it
EXECUTORS: dict[str, str] = {
    "Local": "paratrain.executors.local",
    "DataParallel": "paratrain.executors.data_parallel",
    "ModelParallel": "paratrain.executors.model_parallel",
    "Federated": "paratrain.executors.federated",
    "PopulationBased": "paratrain.executors.population",
    "Custom": "paratrain.executors.custom",
}


def execute(job: JobConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run ``job`` under its strategy and return the summary. Never falls back to Local."""
    kind = getattr(job.strategy, "type", None)
    module_name = EXECUTORS.get(str(kind))
    if module_name is None:
        raise ConfigError(
            [("strategy.type", f"this version cannot run {kind!r}; valid: {', '.join(EXECUTORS)}")]
        )
    module = importlib.import_module(module_name)
    summary: dict[str, Any] = module.run(job, resume=resume)
    return summary
