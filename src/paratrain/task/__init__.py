"""Tasks: what is trained (model, data, loss, metrics), independent of the strategy.

:class:`Task` is the protocol; the built-in tasks are named in a job's ``[task]``; a user's
comes from ``[task] factory = "module:function"`` or, in Python, as an object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..config import ConfigError, one_line
from ..config.job import JobConfig
from ..data.loader import check_stream_job, head, is_stream, stream_batch
from .builtin import TASKS, ClassificationTask, LanguageModelTask, RegressionTask, bigram_loss
from .steps import Task, batch_rows, call_model, evaluate, fetch_batch, model_args, to_device

__all__ = [
    "Task", "TASKS", "ClassificationTask", "RegressionTask", "LanguageModelTask", "bigram_loss",
    "resolve_task", "check_task", "is_default", "job_model", "preflight_task", "evaluate",
    "fetch_batch", "to_device", "batch_rows", "model_args", "call_model",
]

_REQUIRED = ("fitness_metric", "fitness_mode", "datasets", "build_model", "loss", "eval_batch",
             "finalize")


def check_task(obj: Any, *, field: str = "task") -> Task:
    """``obj`` if it has every member of :class:`Task`, else a ConfigError naming ``field``."""
    missing = [m for m in _REQUIRED if not hasattr(obj, m)]
    if missing:
        raise ConfigError([(field, f"{type(obj).__name__} is not a paratrain.Task: it lacks "
                                   f"{', '.join(missing)}")])
    if getattr(obj, "fitness_mode", None) not in ("max", "min"):
        raise ConfigError([(field, f"fitness_mode must be 'max' or 'min' (got "
                                   f"{getattr(obj, 'fitness_mode', None)!r})")])
    return obj  # type: ignore[no-any-return]


def resolve_task(job: JobConfig) -> Task:
    """The task ``job`` names: a built-in by ``task.name`` or the ``task.factory``'s."""
    spec = job.task
    if spec.factory is not None:
        from ..models.zoo import call_factory, import_object

        fn = import_object(spec.factory, field="task.factory")
        obj = call_factory(fn, spec.factory, field="task.factory", offered={}, kwargs=spec.kwargs)
        return check_task(obj, field="task.factory")
    return TASKS[str(spec.name)](job)  # type: ignore[no-any-return]


def is_default(job: JobConfig) -> bool:
    """True for the default classification task (no factory, regression set or corpus)."""
    from ..data.datasets import CORPORA, REGRESSION_DATASETS

    return (job.task.factory is None and job.task.name == "classification"
            and job.data.name not in REGRESSION_DATASETS and job.data.name not in CORPORA)


@contextlib.contextmanager
def _failure_names(field: str, what: str, *, keep_config_errors: bool = True) -> Iterator[None]:
    """A user's task or model failing inside: one ConfigError line naming ``field``."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a user's code: one line naming the field
        if keep_config_errors and isinstance(e, ConfigError):
            raise
        raise ConfigError([(field, one_line(f"{what}: {type(e).__name__}: {e}"))]) from None


def job_model(job: JobConfig, what: str = "building the model failed") -> tuple[Task, Any, Any, Any]:
    """The job's task, its (train, test) datasets and its model, as the executors build them;
    the job's own code failing in them is one ConfigError line naming ``model`` (``what: ...``)."""
    task = resolve_task(job)
    with _failure_names("model", what):
        train, test = task.datasets(job.run.seed)
        return task, train, test, task.build_model(job.model, train)


def preflight_task(job: JobConfig, *, task: Any = None, datasets: Any = None,
                   model: Any = None) -> Any:
    """What ``paratrain validate`` checks for a non-default task: it resolves, its datasets
    load, its model builds and its loss on two training examples is a finite scalar.
    Returns ``train``, ``test`` and ``model``. ``task``, ``datasets`` and ``model``:
    instances :func:`paratrain.fit` received, given the same checks (the model is left in
    its train/eval mode)."""
    import math
    from types import SimpleNamespace

    import torch

    task = task if task is not None else resolve_task(job)
    field = "task.factory" if job.task.factory is not None else "data"
    with _failure_names(field, "loading the task's datasets failed"):
        train, test = datasets if datasets is not None else task.datasets(job.run.seed)
        n_train, n_test = (len(head(d, 2)) if is_stream(d) else len(d) for d in (train, test))
        if is_stream(train):
            check_stream_job(job)
        if n_train < 1 or n_test < 1:
            raise ConfigError([(field, f"the task's datasets are empty (train {n_train}, "
                                       f"test {n_test} examples)")])
    with _failure_names("model", "building the model failed"):
        model = model if model is not None else task.build_model(job.model, train)
    # the items do not collate: name the data
    with _failure_names(field, "two training examples do not make a batch (items may be tensors, "
                        "tuples, dicts or any nesting of them, or the task gives a collate_fn)",
                        keep_config_errors=False):
        collate = getattr(task, "collate_fn", None)
        batch = (stream_batch(train, 2, collate) if is_stream(train) else
                 fetch_batch(train, torch.arange(min(2, n_train)), collate=collate))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), _failure_names(
                "model", "the model or the task's loss fails on two training examples"):
            value = float(task.loss(call_model(task, model, batch), batch))
    finally:
        model.train(was_training)
    if not math.isfinite(value):
        raise ConfigError([("model", f"the task's loss on two training examples is {value}")])
    return SimpleNamespace(train=train, test=test, model=model)
