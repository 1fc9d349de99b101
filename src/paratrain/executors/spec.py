"""What an executor declares about itself: one :class:`ExecutorSpec` per strategy package
(its ``SPEC``): how many processes it starts, what it checks before a run, what it ignores
and what it adds to the reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.effective import Effective
from ..config.job import JobConfig


def capped_workers(job: JobConfig, cap: int, what: str, why: str = "") -> list[str]:
    """A ``notes`` line when ``run.num_workers`` asks for more than ``cap`` workers (``what``
    they would serve, ``why`` the cap)."""
    n = job.run.num_workers
    return [f"run.num_workers: {n} workers for {what}; capped at {cap}{why}"] if n is not None and n > cap else []


@dataclass(frozen=True)
class Traced:
    """A job's model as ``paratrain graph`` traced it: its ``torch.fx`` graph, the training
    set and the model's arguments on two examples (``None`` when not built) and the
    ``[subgraphs]`` table resolved to module paths."""

    job: JobConfig
    model: Any
    gm: Any
    train: Any
    example: Any
    subgraphs: Any


class GraphView:
    """What an executor adds to ``paratrain graph``'s report of a :class:`Traced` model: keys
    for each node row and each subgraph, then sections of its own (this base: only those)."""

    def __init__(self, sections: Callable[[], dict[str, Any]] | None = None) -> None:
        self._sections = sections

    def node(self, path: str, how: str, node: Any, tensors: list[Any]) -> dict[str, Any]:
        """Keys for the row of module ``path`` (``how``: "leaf" or "traced")."""
        return {}

    def group(self, path: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {}

    def sections(self) -> dict[str, Any]:
        return self._sections() if self._sections is not None else {}


@dataclass(frozen=True)
class ExecutorSpec:
    """How one executor runs a job; the floors above read it through
    :func:`paratrain.executors.spec_for` instead of importing a strategy's modules."""

    name: str  # a strategy type, or TensorParallel
    run: Callable[..., dict[str, Any]]  # run(job, *, resume=False, overwrite=False) -> summary
    # (worker processes the job starts, the job field that sets that number): preflight's limit
    processes: Callable[[JobConfig], tuple[int, str]] = lambda job: (1, "strategy.type")
    # settings the executor adjusts rather than refuses (preflight warns with these lines)
    notes: Callable[[JobConfig], list[str]] = lambda job: []
    validate: Callable[[JobConfig], Any] | None = None  # own checks: a ConfigError naming the field
    # checks against the built data (bundle: train, test, model), beside preflight's own
    check_data: Callable[[JobConfig, Any], None] | None = None
    # ignores(job, resume=..., probe=...): settings ignored beyond the rules the job alone tells
    # (paratrain.config.effective), those needing the executor's code (e.g. the model it builds)
    ignores: Callable[..., Effective] | None = None
    describe: Callable[[JobConfig], list[str]] = lambda job: []  # `paratrain validate`'s lines on it
    graph: Callable[[Traced], GraphView] = lambda traced: GraphView()  # what `paratrain graph` adds
