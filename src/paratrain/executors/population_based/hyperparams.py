"""What a PBT member can be: the roles of its hyperparameters (:func:`hyperparameter_roles`),
the metric it is ranked by, and the PopulationBased checks that need the factories. Model
keywords may change parameter shapes, so explore leaves them alone (sampled at the start,
inherited on exploit) -- except ``dropout``, explored like the optimizer's values and set as
the ``p`` of every ``nn.Dropout`` each generation (as Ray Tune's PBT re-applies a config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...config import ConfigError
from ...config.job import ChoiceDim, JobConfig
from ...data import DATASETS
from ...models.zoo import MODELS, import_object
from ...task import resolve_task
from ...training import build_optimizer
from ...training.faults import FAULTS_ENV, injected_faults
from ..plugins import keywords
from .pbt import validate_space

TRAIN_METRICS = ("train_loss",)  # besides the task's test metrics: the mean loss of its steps
_DATA_FIXED = {"seed", "test_fraction"}
_MODEL_FIXED = {"input_shape", "num_classes"}


def _builder(spec: Any, section: str, registry: Any) -> Callable[..., Any]:
    if spec.factory is not None:
        return import_object(spec.factory, field=f"{section}.factory")
    return registry.get(str(spec.name), lambda: None)


def hyperparameter_roles(job: JobConfig) -> tuple[dict[str, str], str | None]:
    """``{name: role}`` (``batch``, ``optimizer`` for any key of the optimizer's param groups,
    ``model``, ``data``, ``dropout``) for every hyperparameter a member can carry, and the
    role (``model``/``data``) whose builder takes ``**kwargs``, if any."""
    roles: dict[str, str] = {}
    probe = build_optimizer([torch.zeros(1, requires_grad=True)], job.train.optimizer)
    for k in probe.param_groups[0]:
        if k != "params":
            roles.setdefault(k, "optimizer")
    roles["batch_size"] = "batch"
    m_names, m_open = keywords(_builder(job.model, "model", MODELS), _MODEL_FIXED) or ([], True)
    d_names, d_open = keywords(_builder(job.data, "data", DATASETS), _DATA_FIXED) or ([], True)
    for k in sorted({*m_names, *job.model.kwargs}):
        roles.setdefault(k, "dropout" if k == "dropout" else "model")
    for k in sorted({*d_names, *job.data.kwargs}):
        roles.setdefault(k, "data")
    return roles, ("model" if m_open else "data" if d_open else None)


def task_metrics(task: Any) -> list[str] | None:
    """The metrics a member can be ranked by: the task's evaluation metrics (the keys its
    ``finalize`` returns, read from ``finalize`` of empty sums) and ``train_loss``; None when
    ``finalize`` cannot say (the first evaluation checks the metric then)."""
    try:
        keys = [str(k) for k in task.finalize({"count": 0.0})]
    except Exception:  # noqa: BLE001 - a user's finalize may need real sums
        return None
    return [*keys, *(m for m in TRAIN_METRICS if m not in keys)]


def task_name(task: Any) -> str:
    return str(getattr(task, "name", type(task).__name__))


def unknown_metric(metric: str, task: Any, names: list[str]) -> str:
    return (f"{metric!r} is not a metric of the {task_name(task)} task; valid: "
            f"{', '.join(names)}")


def fitness_of(job: JobConfig, task: Any) -> tuple[str, str]:
    """``(metric, mode)`` members are ranked by: ``population.metric`` or the task's
    ``fitness_metric``; ``population.mode`` or the task's ``fitness_mode``."""
    opts = job.population
    metric = opts.metric if opts.metric is not None else str(task.fitness_metric)
    mode = opts.mode if opts.mode is not None else str(task.fitness_mode)
    return metric, mode


def validate_job(job: JobConfig) -> dict[str, str]:
    """All PopulationBased checks that need the factories; returns the roles."""
    strategy = job.strategy
    if getattr(strategy, "type", None) != "PopulationBased":
        raise ConfigError([("strategy.type", f"expected PopulationBased (got {strategy.type!r})")])
    roles, open_role = hyperparameter_roles(job)
    validate_space(job.search_space, known=roles, open_names=open_role is not None)
    problems: list[tuple[str, str]] = []
    task = resolve_task(job)
    metric, _ = fitness_of(job, task)
    names = task_metrics(task)
    if names is not None and metric not in names:
        problems.append(("population.metric", unknown_metric(metric, task, names)))
    if job.task.factory is not None:
        for name in sorted(job.search_space):
            if roles.get(name) == "data":
                problems.append((f"search_space.{name}", (
                    f"{name!r} is a keyword of the data builder, which a task.factory does not "
                    "use (the task builds its own datasets)")))
    n = strategy.population_size  # type: ignore[union-attr]
    bad = sorted(i for i in injected_faults().fail_members if i >= n)
    if bad:
        problems.append((f"{FAULTS_ENV}.fail_members", f"member index {bad[0]} >= population_size {n}"))
    for name in sorted(job.search_space):  # every extreme value must build an optimizer
        if roles.get(name) != "optimizer":
            continue
        dim = job.search_space[name]
        values = dim.values if isinstance(dim, ChoiceDim) else [dim.low, dim.high]
        for v in values:
            try:
                build_optimizer([torch.zeros(1, requires_grad=True)], job.train.optimizer, **{name: v})
            except ConfigError as e:
                problems.append((f"search_space.{name}", f"{name}={v!r} is invalid: {e.problems[0][1]}"))
                break
    if problems:
        raise ConfigError(problems)
    for name in job.search_space:  # accepted by a factory's **kwargs
        roles.setdefault(name, open_role or "model")
    return roles
