"""Which executor module runs a job: by strategy type, with tensor parallelism on top.

A leaf of the import graph (config and task only): the launcher, the worker entry point,
preflight and ``executors.execute`` all ask it, and executor modules are imported by name
(``importlib``) on dispatch, so a strategy's dependencies load only when it runs.
"""

from __future__ import annotations

import importlib

from .config import ConfigError
from .config.job import JobConfig

__all__ = ["EXECUTORS", "TENSOR_PARALLEL", "executor_module", "is_tensor_parallel", "check_supported"]

# strategy "type" -> module implementing it
EXECUTORS: dict[str, str] = {
    "Local": "paratrain.executors.local",
    "DataParallel": "paratrain.executors.data_parallel.runner",
    "ModelParallel": "paratrain.executors.model_parallel.runner",
    "Federated": "paratrain.executors.federated",
    "PopulationBased": "paratrain.executors.population_based.runner",
    "Custom": "paratrain.executors.custom",
}


TENSOR_PARALLEL = "paratrain.executors.tensor_parallel.runner"


def is_tensor_parallel(job: JobConfig) -> bool:
    """A Local or DataParallel job with ``tensor_parallel_size > 1``."""
    return executor_module(job) == TENSOR_PARALLEL


def executor_module(job: JobConfig) -> str:
    """The module that runs ``job``: by strategy type, except that a Local or DataParallel
    job with ``tensor_parallel_size > 1`` runs on the tensor-parallel executor."""
    kind = str(getattr(job.strategy, "type", None))
    tp = job.tensor_parallel
    if tp is not None and tp.tensor_parallel_size > 1 and kind in ("Local", "DataParallel"):
        return TENSOR_PARALLEL
    module_name = EXECUTORS.get(kind)
    if module_name is None:
        raise ConfigError(
            [("strategy.type", f"this version cannot run {kind!r}; valid: {', '.join(EXECUTORS)}")]
        )
    return module_name


def check_supported(job: JobConfig) -> None:
    """ConfigError unless ``job``'s task runs under its strategy: an executor module that
    trains any Task through the one loop says so with ``SUPPORTS_TASKS = True``; the others
    train only the default classification task."""

    from .task import is_default

    module = executor_module(job)
    if getattr(importlib.import_module(module), "SUPPORTS_TASKS", False):
        return
    kind = str(getattr(job.strategy, "type", "?"))
    if is_default(job):
        return
    where = "tensor-parallel Local" if module == TENSOR_PARALLEL and kind == "Local" else kind
    if job.task.factory is not None:
        field, what = "task.factory", f"a task factory ({job.task.factory!r})"
    elif job.task.name != "classification":
        field, what = "task.name", f"task.name = {job.task.name!r}"
    else:
        field, what = "data.name", f"data.name = {job.data.name!r} (not a classification set)"
    raise ConfigError([(field, f"{what} cannot run under {where} in this version: it trains "
                               "only the classification task")])
