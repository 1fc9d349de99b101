"""What an executor declares about itself: one :class:`ExecutorSpec` per strategy package.

Each strategy package exports ``SPEC`` (``paratrain.executors.local.SPEC``,
``paratrain.executors.data_parallel.SPEC``, ...). The floors above the executors (dispatch,
preflight, the ignored-settings report, ``paratrain validate`` and ``paratrain graph``) find
a job's spec through :func:`paratrain.executors.spec_for` and read it, instead of importing
a strategy's modules; an executor states here, next to its code, how many processes it
starts, what it checks before a run, what it ignores and what it adds to the reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.effective import Effective
from ..config.job import JobConfig

__all__ = ["ExecutorSpec", "GraphView", "Traced", "in_process", "capped_workers"]


def in_process(job: JobConfig) -> tuple[int, str]:
    """One process: the executor runs in the caller's (Local, a Custom coordinator)."""
    return 1, "strategy.type"


def capped_workers(job: JobConfig, cap: int, what: str, why: str = "") -> list[str]:
    """A ``notes`` line when ``run.num_workers`` asks for more than ``cap`` workers (``what``
    they would serve, ``why`` the cap)."""
    n = job.run.num_workers
    return [f"run.num_workers: {n} workers for {what}; capped at {cap}{why}"] if n is not None and n > cap else []


@dataclass(frozen=True)
class Traced:
    """A job's model as ``paratrain graph`` traced it (:func:`paratrain.explain.explain`):
    the job, the model, its ``torch.fx`` graph, the training set (``None`` when not built),
    the model's arguments on two examples (or ``None``) and the ``[subgraphs]`` table
    resolved to module paths."""

    job: JobConfig
    model: Any
    gm: Any
    train: Any
    example: Any
    subgraphs: Any


class GraphView:
    """What an executor adds to ``paratrain graph``'s report of a :class:`Traced` model.
    :func:`paratrain.explain.explain` asks it, in order, for each node row's extra keys
    (:meth:`node`), each subgraph's (:meth:`group`), then the report's own sections
    (:meth:`sections`). This base adds no keys and the sections ``sections()`` returns
    (none without it); an executor that places nodes subclasses it."""

    def __init__(self, sections: Callable[[], dict[str, Any]] | None = None) -> None:
        self._sections = sections

    def node(self, path: str, how: str, node: Any, tensors: list[Any]) -> dict[str, Any]:
        """Keys for the row of module ``path`` (``how``: "leaf" or "traced"), whose fx node
        is ``node`` and whose counted parameters are ``tensors``."""
        return {}

    def group(self, path: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Keys for the subgraph at ``path``, given every node row."""
        return {}

    def sections(self) -> dict[str, Any]:
        """The report's sections this executor adds (placement, mesh, shards, ...)."""
        return self._sections() if self._sections is not None else {}


def _no_lines(job: JobConfig) -> list[str]:
    return []


def _plain_view(traced: Traced) -> GraphView:
    return GraphView()


@dataclass(frozen=True)
class ExecutorSpec:
    """How one executor runs a job (see the module docstring).

    - ``name``: the executor (a strategy type, or ``TensorParallel``);
    - ``run(job, *, resume=False, overwrite=False) -> summary``;
    - ``processes(job) -> (count, field)``: worker processes the job starts and the job
      field that sets the number (preflight's process limit names it; a ConfigError when
      the job names workers it does not have);
    - ``notes(job) -> lines``: settings the executor adjusts rather than refuses (preflight
      warns with them);
    - ``validate(job)``: the executor's own checks before a run (a ConfigError naming the
      field), or ``None``;
    - ``check_data(job, bundle)``: checks of the job against its built data (``bundle``:
      ``train``, ``test``, ``model``), made by preflight beside its other checks, or ``None``;
    - ``ignores(job, resume=..., probe=...) -> Effective``: settings this executor ignores
      beyond the rules :func:`paratrain.config.effective.effective_settings` knows from the
      job alone (those that need the executor's code, e.g. the model it builds); its
      ``settings`` update the report's;
    - ``describe(job) -> lines``: what ``paratrain validate`` prints about how the job will
      run (a ConfigError when that cannot be worked out);
    - ``graph(traced) -> GraphView``: what ``paratrain graph`` adds for this executor.
    """

    name: str
    run: Callable[..., dict[str, Any]]
    processes: Callable[[JobConfig], tuple[int, str]] = in_process
    notes: Callable[[JobConfig], list[str]] = _no_lines
    validate: Callable[[JobConfig], Any] | None = None
    check_data: Callable[[JobConfig, Any], None] | None = None
    ignores: Callable[..., Effective] | None = None
    describe: Callable[[JobConfig], list[str]] = _no_lines
    graph: Callable[[Traced], GraphView] = _plain_view
