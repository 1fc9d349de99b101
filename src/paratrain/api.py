"""Python API: ``paratrain.fit(...)`` returns the same summary the CLI writes."""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import ConfigError
from .config.job import JobConfig, load_job
from .data import DataBundle

__all__ = ["fit"]


def _section(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, dict):  # e.g. subgraphs={"head": Local()}
        return {k: _section(v) for k, v in value.items()}
    return value


def fit(
    job: JobConfig | dict[str, Any] | str | None = None,
    *,
    model: str | dict[str, Any] | nn.Module | None = None,
    data: str | dict[str, Any] | DataBundle | None = None,
    task: str | dict[str, Any] | Any = None,
    strategy: Any = None,
    resume: bool = False,
    overwrite: bool = False,
    **sections: Any,
) -> dict[str, Any]:
    """Train and return the run summary.

    ``job`` is a JobConfig, a dict, or a job-file path; keyword sections (``train=``,
    ``run=``, ``compression=``, ``tensor_parallel=``, ``workers=``, ...) override it.
    ``model``/``data`` may be zoo names, spec dicts, or (for the Local strategy) an
    ``nn.Module`` / :class:`DataBundle` instance used as is. ``task`` is a built-in task
    name (``"regression"``), a ``[task]`` dict, or (Local) a :class:`paratrain.Task` object
    whose datasets, model, loss and metrics are trained. A run folder that already
    holds a run is never replaced implicitly: pass ``overwrite=True`` to replace it or
    ``resume=True`` to continue it. ``subgraphs={"head": {"type": "Local"}}`` is the job
    file's ``[subgraphs]`` table (strategies on modules of the model, :mod:`paratrain.subgraphs`).

    >>> summary = paratrain.fit(model="mlp", data="digits", train={"epochs": 3})
    """
    from .dispatch import execute

    if isinstance(job, JobConfig):
        doc: dict[str, Any] = job.model_dump(mode="json", exclude_unset=True)
    elif isinstance(job, str):
        doc = load_job(job).model_dump(mode="json", exclude_unset=True)
    else:
        doc = dict(job or {})
    instance_model = model if isinstance(model, nn.Module) else None
    instance_data = data if isinstance(data, DataBundle) else None
    instance_task = task if task is not None and not isinstance(task, str | dict) else None
    if isinstance(task, str):
        doc["task"] = {"name": task}
    elif isinstance(task, dict):
        doc["task"] = task
    if isinstance(model, str):
        doc["model"] = {"name": model}
    elif isinstance(model, dict):
        doc["model"] = model
    if isinstance(data, str):
        doc["data"] = {"name": data}
    elif isinstance(data, dict):
        doc["data"] = data
    if strategy is not None:
        doc["strategy"] = _section(strategy)
    for key, value in sections.items():
        doc[key] = _section(value)
    cfg = load_job(doc)
    if instance_task is not None:
        from .task import check_task

        check_task(instance_task, field="task")
    if instance_model is not None or instance_data is not None or instance_task is not None:
        if cfg.strategy.type != "Local" or cfg.tensor_parallel is not None and cfg.tensor_parallel.tensor_parallel_size > 1:
            field = "task" if instance_task is not None else "model"
            raise ConfigError([(field, "model/data/task instances are supported with the Local "
                                "strategy; use a factory ('module:function') for multi-process "
                                "strategies")])
        from .preflight import Instances

        # the same checks and warnings as a job file's run, on the objects themselves
        return execute(cfg, resume=resume, overwrite=overwrite,
                       instances=Instances(instance_model, instance_data, instance_task))
    return execute(cfg, resume=resume, overwrite=overwrite)
