"""Checking a ModelParallel job before any launch (``paratrain validate``, :func:`.runner.run`):
how many worker processes it needs, the placement of its partitions (:class:`~.plan.Plan`),
and what a placement must not do (a parameter split across workers, a non-tensor value
crossing between them). Every rank then plans the same way on the same seeded model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...comm.context import default_workers
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import WorkerIdTarget
from ...task import job_model
from ...task.steps import example_args
from ...training import seed_everything
from .plan import Plan, build_plan, check_interleaved, replicas_for
from .tp_stages import check_job, dry_shard, tp_size_of


def _worker_numbers(strategy: Any) -> Iterator[tuple[int, str, int]]:
    """``(partition index, id, k)`` of each partition targeting ``worker-<k>``."""
    for i, part in enumerate(getattr(strategy, "partitions", [])):
        if isinstance(part.target, WorkerIdTarget):
            m = re.fullmatch(r"worker-(\d+)", part.target.WorkerId)
            if m:
                yield i, part.target.WorkerId, int(m.group(1))


def check_worker_ids(job: JobConfig) -> None:
    """Without ``[[workers]]`` and ``run.num_workers`` the workers are ``worker-0 ..
    worker-P`` for ``P`` partitions: a ConfigError for each ``WorkerId`` beyond those (an
    implicit world is never made larger by a typo)."""
    if job.workers or job.run.num_workers is not None:
        return
    top = len(job.strategy.partitions)  # type: ignore[union-attr]
    problems = [(f"strategy.partitions[{i}].target.WorkerId", (
        f"no worker {wid!r}: without [[workers]] or run.num_workers this job's workers are "
        f"worker-0..worker-{top} (one per partition, plus rank 0 for the nodes no partition "
        f"claims); declare the workers in [[workers]]"))
        for i, wid, k in _worker_numbers(job.strategy) if k > top]
    if problems:
        raise ConfigError(problems)


def num_workers(job: JobConfig) -> int:
    """Processes a ModelParallel job needs: ``[[workers]]`` count, else ``run.num_workers``,
    else one more than the highest ``worker-<k>`` a partition targets (at least 1) plus the
    workers the replicated stages add beyond their primaries."""
    if job.workers:
        return len(job.workers)
    if job.run.num_workers is not None:
        return job.run.num_workers
    highest = max((k for _, _, k in _worker_numbers(job.strategy)), default=0)
    return highest + 1 + sum(int(s.num_replicas) - 1 for s in job.subgraphs.values()
                             if s.type == "DataParallel")


def plan_for(job: JobConfig, model: torch.nn.Module, workers: list[Any],
             example: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
             leaves: tuple[str, ...] = ()) -> Plan:
    """Validate the job's partitions against ``model`` and ``workers``; the placement.
    ``example``: the model's arguments on a batch, to capture a model fx cannot trace with
    torch.export (:func:`example_args`)."""
    strategy: Any = job.strategy
    if getattr(strategy, "type", None) != "ModelParallel":
        raise ConfigError([("strategy.type", f"expected ModelParallel (got {strategy.type!r})")])
    proto: Any = strategy.communication
    pipeline = proto.protocol == "Pipeline"
    interleaved = pipeline and proto.schedule == "Interleaved1F1B"
    plan = build_plan(model, strategy.partitions, workers, contiguous=pipeline and not interleaved,
                      leaves=tuple(getattr(job.model, "leaf_modules", ()) or ()) + leaves,
                      example=example)
    if interleaved:
        check_interleaved(plan, workers, proto.virtual_stages)
    if plan.cut.capture == "fx":  # an exported graph reads every parameter by get_attr
        check_shared_parameters(model, plan)
    return plan


def check_shared_parameters(model: nn.Module, plan: Plan) -> None:
    """A ConfigError when one Parameter sits inside leaf modules placed on different ranks
    (each rank would step its own copy). A tie read through an attribute (the ``gpt`` head
    reading the embedding's weight) is fine: readers receive it (:mod:`.runtime`)."""
    owners: dict[int, tuple[str, str]] = {}
    for node in plan.nodes:
        for pname, param in model.get_submodule(node).named_parameters(remove_duplicate=False):
            first = owners.setdefault(id(param), (node, pname))
            if plan.owner[first[0]] == plan.owner[node]:
                continue
            a, b = f"{first[0]}.{first[1]}", f"{node}.{pname}"
            ra, rb = plan.owner[first[0]], plan.owner[node]
            raise ConfigError([("strategy.partitions", (
                f"{b} is the same Parameter as {a}, but node {node!r} runs on rank {rb} and "
                f"{first[0]!r} on rank {ra}: a parameter shared by two placed modules cannot "
                f"be split across workers; untie it or place both nodes on one worker"))])


def task_model(job: JobConfig) -> tuple[Any, Any, Any, nn.Module]:
    """:func:`paratrain.task.job_model`, seeded as every rank builds it."""
    seed_everything(job.run.seed)
    return job_model(job)


def validate(job: JobConfig) -> Plan:
    """The placement of ``job``'s partitions on its workers (``paratrain validate`` and
    ``run`` call this): builds the task's model to learn its node ids, then raises a
    ConfigError naming the culprit for every placement error DESIGN §4 lists."""
    check_job(job)  # pipeline x tensor parallel: what it does not run
    n = num_workers(job)
    task, train, _, model = task_model(job)
    workers = default_workers(n, list(job.workers))
    plan = plan_for(job, model, workers, example_args(task, train))
    if tp_size_of(job) > 1:
        dry_shard(job, task.build_model(job.model, train))  # sharding errors before a launch
    replicas_for(job, plan, n)
    check_crossing_values(plan, model, train, workers, task)
    return plan


@torch.no_grad()
def check_crossing_values(plan: Plan, model: nn.Module, train: Any, workers: list[Any],
                          task: Any = None) -> None:
    """Run the parts once on two training examples and refuse a value that would cross
    workers but is not a tensor (an int from ``x.size(1)``): a ConfigError naming the value,
    the worker that makes it and the one that reads it."""
    from .runtime import model_inputs

    example = example_args(task, train)
    if example is None:
        return
    c = plan.cut
    env: dict[str, Any] = model_inputs(c, *example)
    for a in c.attrs:
        env[a.name] = a.value(model)
    was = model.training
    model.eval()
    try:
        for p in c.parts:
            out = p.module(*[env[v] for v in p.inputs])
            env.update(zip(p.outputs, out if len(p.outputs) > 1 else (out,), strict=True))
    finally:
        model.train(was)
    problems = []
    for t in c.transfers:
        val = env.get(t.value)
        if val is not None and not isinstance(val, torch.Tensor):
            made = next((",".join(p.nodes) for p in c.parts if t.value in p.outputs), "")
            problems.append(("strategy.partitions", (
                f"{t.value!r}, a {type(val).__name__} ({val!r:.40}), is made on {workers[t.src].id} (after "
                f"{made or 'its nodes'}) is read on {workers[t.dst].id}: only tensors travel "
                f"between workers; place the nodes that make and read it on one worker")))
    if problems:
        raise ConfigError(problems)
