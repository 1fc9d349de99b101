"""What an executor declares about itself: one :class:`ExecutorSpec` per strategy package
(its ``SPEC``): how many processes it starts, what it checks before a run, what it ignores
and what it adds to the reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.effective import Effective
from ..config.job import JobConfig


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
    """What an executor adds to ``paratrain graph``'s report of a :class:`Traced` model: keys
    for each node row (:meth:`node`) and each subgraph (:meth:`group`), then sections of its
    own. This base adds the sections ``sections()`` returns; one that places nodes subclasses it."""

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
        return self._sections() if self._sections is not None else {}


def _no_lines(job: JobConfig) -> list[str]:
    return []


def _plain_view(traced: Traced) -> GraphView:
    return GraphView()


@dataclass(frozen=True)
class ExecutorSpec:
    """How one executor runs a job; the floors above read it through
    :func:`paratrain.executors.spec_for` instead of importing a strategy's modules."""

    name: str  # a strategy type, or TensorParallel
    run: Callable[..., dict[str, Any]]  # run(job, *, resume=False, overwrite=False) -> summary
    # (worker processes the job starts, the job field that sets that number): preflight's limit
    processes: Callable[[JobConfig], tuple[int, str]] = in_process
    # settings the executor adjusts rather than refuses (preflight warns with these lines)
    notes: Callable[[JobConfig], list[str]] = _no_lines
    validate: Callable[[JobConfig], Any] | None = None  # own checks: a ConfigError naming the field
    # checks against the built data (bundle: train, test, model), beside preflight's own
    check_data: Callable[[JobConfig, Any], None] | None = None
    # ignores(job, resume=..., probe=...): settings ignored beyond the rules the job alone tells
    # (paratrain.config.effective), those needing the executor's code (e.g. the model it builds)
    ignores: Callable[..., Effective] | None = None
    describe: Callable[[JobConfig], list[str]] = _no_lines  # `paratrain validate`'s lines on it
    graph: Callable[[Traced], GraphView] = _plain_view  # what `paratrain graph` adds
