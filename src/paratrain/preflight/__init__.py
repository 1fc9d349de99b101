"""Everything a run checks before it trains, in one place (issue 13, "safe by default").

:func:`preflight` is called by ``paratrain validate`` and by :func:`paratrain.dispatch.execute`
before any executor runs, so ``validate`` accepts exactly the jobs ``run`` can start and a job
that cannot run fails before any worker process is spawned: ``run.imports`` (and a Custom
coordinator they register), ``run.device``/``run.backend`` against CUDA, the worker processes
the executor's spec declares, the task, data, model and optimizer built and run on two
training rows (:mod:`.build`), ``[subgraphs]``, and the spec's ``check_data`` and
``validate``.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig
from ..subgraphs import check_pairings, check_paths
from .build import _build

# Worker processes per CPU core a job may start without run.allow_oversubscribe: the
# test suite runs 4 ranks on 2 cores; beyond a few per core, gloo ranks only fight for
# the CPU (and a typo of 1000 would fork-bomb the machine).
PROCS_PER_CORE = 4

Problems = list[tuple[str, str]]


class PreflightWarning(UserWarning):
    """A setting preflight adjusts instead of refusing (e.g. a capped worker count)."""


@dataclass(frozen=True)
class Instances:
    """Objects :func:`paratrain.fit` received in place of the job's specs (Local only): an
    ``nn.Module``, a :class:`~paratrain.data.DataBundle`, a Task. Preflight checks them
    as it checks what the specs build (two examples through the model and the loss, the
    optimizer over the model's parameters, ``[subgraphs]`` paths); the executor trains them."""

    model: Any = None
    data: Any = None
    task: Any = None


def process_limit() -> int:
    """Worker processes one machine may host: ``cpu_count() x PROCS_PER_CORE``."""
    return (os.cpu_count() or 1) * PROCS_PER_CORE


def process_count(job: JobConfig) -> tuple[int, str]:
    """(worker processes the job starts, the field that sets that number), as the job's
    executor declares them (``ExecutorSpec.processes``)."""
    from ..executors import spec_for

    return spec_for(job).processes(job)


def preflight(job: JobConfig, *, job_dir: Path | None = None, warn: bool = True,
              instances: Instances | None = None) -> list[str]:
    """Check ``job`` as ``run`` would before training: one ConfigError listing every problem,
    each naming its field. ``job_dir`` is the job file's folder (relative ``run.imports``);
    ``instances`` what :func:`paratrain.fit` trains instead of the job's specs. Returns the
    settings the spec adjusts rather than refuses (its ``notes``) as warning lines; with
    ``warn`` each is also issued as a PreflightWarning."""
    problems: Problems = []
    notes: list[str] = []
    imported = _stage(problems, _imports, job, job_dir)
    _stage(problems, _device, job)
    strategy_ok = _stage(problems, _processes, job, notes)
    if imported:
        _stage(problems, _coordinator, job)
    pairings_ok = _stage(problems, check_pairings, job)
    bundle = _stage(problems, _build, job, instances) if imported else None
    if bundle is not None and pairings_ok:
        _stage(problems, check_paths, bundle.model, job)
    if bundle is not None:
        _stage(problems, _spec_check, job, "check_data", bundle)
        if strategy_ok and not problems:
            _stage(problems, _spec_check, job, "validate")
    # The checked model is garbage now; an import inside a stage (spec_for's executor
    # package) can leave cyclic garbage holding this frame, and the frame its locals: drop it
    # here, so that while `paratrain run` pauses collection (training.gcfreeze) it is freed.
    del bundle
    if warn:
        for note in notes:
            warnings.warn(note, PreflightWarning, stacklevel=2)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # each problem once, in order
    return notes


def _stage(problems: Problems, fn: Any, *args: Any) -> Any:
    """Run one check: its ConfigError problems are collected; returns its result, or
    True when it returns nothing, or None when it failed."""
    try:
        out = fn(*args)
    except ConfigError as e:
        problems.extend(e.problems)
        return None
    return True if out is None else out


def _imports(job: JobConfig, job_dir: Path | None) -> None:
    from ..executors import import_plugins

    import_plugins(list(job.run.imports), base=job_dir)


def _coordinator(job: JobConfig) -> None:
    s: Any = job.strategy
    if getattr(s, "type", None) != "Custom":
        return
    from ..executors import registered_coordinators

    known = registered_coordinators()
    if s.coordinator not in known:
        hint = ", ".join(known) or "none registered (list the module that registers it in run.imports)"
        raise ConfigError([("strategy.coordinator", f"no coordinator named {s.coordinator!r}; registered: {hint}")])


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _device(job: JobConfig) -> None:
    run = job.run
    problems: Problems = []
    if run.device == "cuda" and not _cuda():
        problems.append(("run.device", "'cuda' requested but CUDA is not available on this machine; "
                                       "use 'auto' or 'cpu'"))
    if run.backend == "nccl":
        if run.device == "cpu":
            problems.append(("run.backend", "'nccl' moves CUDA tensors only and run.device is 'cpu'; "
                                            "use 'gloo' or 'auto'"))
        elif not _cuda():
            problems.append(("run.backend", "'nccl' needs CUDA, which this machine does not have; "
                                            "use 'gloo' or 'auto'"))
    if problems:
        raise ConfigError(problems)


def _processes(job: JobConfig, notes: list[str]) -> None:
    from ..comm.rendezvous import ENV_NNODES, in_torchrun
    from ..executors import spec_for

    notes += spec_for(job).notes(job)
    n, field = process_count(job)
    if in_torchrun() or job.run.allow_oversubscribe:
        return  # torchrun chose the world; or the user lifted the limit
    try:
        nnodes = max(1, int(os.environ.get(ENV_NNODES, "1")))
    except ValueError:
        nnodes = 1
    here = math.ceil(n / nnodes)
    limit = process_limit()
    if here > limit:
        per = f" ({n} over {nnodes} machines)" if nnodes > 1 else ""
        raise ConfigError([(field, (
            f"the job would start {here} worker processes on this machine{per}, more than it can "
            f"take: {os.cpu_count() or 1} CPU cores x {PROCS_PER_CORE} = {limit}; lower it or set "
            f"run.allow_oversubscribe = true"))])


def _spec_check(job: JobConfig, name: str, *args: Any) -> None:
    """The executor spec's check ``name`` (``check_data`` against the built data, or its own
    ``validate``), when it has one."""
    from ..executors import spec_for

    check = getattr(spec_for(job), name)
    if check is not None:
        check(job, *args)
