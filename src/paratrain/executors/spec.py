"""What an executor declares about itself: one :class:`ExecutorSpec` per strategy package.

Each strategy package exports ``SPEC`` (``paratrain.executors.local.SPEC``,
``paratrain.executors.data_parallel.SPEC``, ...). The floors above the executors (dispatch,
preflight, the ignored-settings report, ``paratrain graph``) find a job's spec through
:func:`paratrain.executors.spec_for` and read it, instead of importing a strategy's modules
and looking attributes up on them; an executor states here, next to its code, how many
processes it starts, what it checks before a run, what it ignores and which tasks it trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.effective import Effective
from ..config.job import JobConfig

__all__ = ["ExecutorSpec", "in_process"]


def in_process(job: JobConfig) -> tuple[int, str]:
    """One process: the executor runs in the caller's (Local, a Custom coordinator)."""
    return 1, "strategy.type"


@dataclass(frozen=True)
class ExecutorSpec:
    """How one executor runs a job (see the module docstring).

    - ``name``: the executor (a strategy type, or ``TensorParallel``);
    - ``run(job, *, resume=False, overwrite=False) -> summary``;
    - ``worker(ctx, job, resume)``: what each launched worker process runs (``None``: the
      executor launches no processes); the executor passes it to
      :func:`paratrain.comm.launch.launch` itself;
    - ``processes(job) -> (count, field)``: worker processes the job starts and the job
      field that sets the number (preflight's process limit names it);
    - ``validate(job)``: the executor's own checks before a run (a ConfigError naming the
      field), or ``None``;
    - ``ignores(job, resume=..., probe=...) -> Effective``: settings this executor ignores
      beyond the rules :func:`paratrain.config.effective.effective_settings` knows from the
      job alone (those that need the executor's code, e.g. the model it builds); its
      ``settings`` update the report's;
    - ``supports_tasks``: trains any :class:`~paratrain.task.Task`, not only the default
      classification task.
    """

    name: str
    run: Callable[..., dict[str, Any]]
    worker: Callable[..., Any] | None = None
    processes: Callable[[JobConfig], tuple[int, str]] = in_process
    validate: Callable[[JobConfig], Any] | None = None
    ignores: Callable[..., Effective] | None = None
    supports_tasks: bool = True
