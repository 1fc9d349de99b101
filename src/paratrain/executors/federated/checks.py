"""The federated job's own checks (option values that cannot work, naming the field) and
each client's tags; used by the workers and by :mod:`paratrain.preflight`."""

from __future__ import annotations

from typing import Any

from ...comm.context import WorkerContext
from ...config import ConfigError
from ...config.flower import secure_problems
from ...config.job import JobConfig
from ...training.faults import FAULTS_ENV, injected_faults
from .buffered import fedbuff_problems
from .client import SLOW_ENV, client_name, slow_client
from .drift import drift_problems
from .privacy import dp_problems
from .selection import select_clients


def check_job(job: JobConfig, *, world_size: int) -> None:
    """Reject option values that cannot work, naming the field."""
    strat: Any = job.strategy
    k = strat.num_clients
    problems: list[tuple[str, str]] = []
    faults = injected_faults()
    for field in ("fail_clients", "byzantine_clients", "corrupt_clients"):
        bad = sorted(c for c in getattr(faults, field) if not 0 <= c < k)
        if bad:
            problems.append((f"{FAULTS_ENV}.{field}", f"client indices {bad} outside [0, {k})"))
    slow = slow_client()  # a test/benchmark injection (.client.SLOW_ENV)
    if slow is not None and not 0 <= slow[0] < k:
        problems.append((SLOW_ENV, f"client {slow[0]} outside [0, {k})"))
    for name in job.federated.client_tags:
        c = name.removeprefix("client-")
        if not name.startswith("client-") or not c.isdigit() or int(c) >= k:
            problems.append(("federated.client_tags", f"unknown client {name!r} (clients are client-0..client-{k - 1})"))
    target = job.federated.target_accuracy
    if target is not None and job.task.factory is None and job.task.name != "classification":
        problems.append(("federated.target_accuracy", (
            f"task.name = {job.task.name!r} has no accuracy metric; only a classification "
            "task can stop at a target accuracy")))
    problems.extend(drift_problems(job))  # SCAFFOLD / FedNova with an optimizer they cannot use
    problems.extend(dp_problems(job))  # [federated.dp] with an aggregator it cannot serve
    problems.extend(secure_problems(job))  # Flower's SecAgg+ reveals only the sum
    if problems:
        raise ConfigError(problems)


def client_tags(job: JobConfig, ctx: WorkerContext) -> dict[int, list[str]]:
    """Each client's tags: its ``[federated.client_tags]`` entry plus its worker's tags."""
    strat: Any = job.strategy
    out: dict[int, list[str]] = {}
    for c in range(strat.num_clients):
        own = list(job.federated.client_tags.get(client_name(c), []))
        worker = ctx.workers[c % ctx.world_size] if ctx.workers else None
        out[c] = sorted(set(own) | set(worker.tags if worker else ()))
    return out


def check_data(job: JobConfig, bundle: Any) -> None:
    """Preflight's checks against the built data: a row per client, :func:`check_job`, the
    partition and per-client splits, a satisfiable ``ByCapability``."""
    from ...comm.context import default_workers
    from ...config import one_line
    from ...data.partition import partition_dataset
    from . import num_workers

    s: Any = job.strategy
    rows = len(bundle.train)
    if s.num_clients > rows:
        raise ConfigError([("strategy.num_clients", f"{s.num_clients} clients but the training set "
                                                    f"has {rows} rows: every client needs at least one")])
    world = num_workers(job)
    check_job(job, world_size=world)
    try:
        parts = partition_dataset(bundle.train, s.num_clients, job.data.partition, seed=job.run.seed)
        if job.data.partition.feature_shift > 0 or job.subgraphs or job.federated.evaluate_clients:
            from ...data.partition import client_datasets  # per-client test splits, shifts

            client_datasets(bundle.train, bundle.test, parts, job.data.partition, seed=job.run.seed)
    except ValueError as e:
        raise ConfigError([("data.partition", one_line(str(e)))]) from None
    ctx = WorkerContext(rank=0, world_size=world, workers=default_workers(world, list(job.workers)))
    check_selection(job, client_tags(job, ctx))


def check_selection(job: JobConfig, tags: dict[int, list[str]]) -> None:
    """A ``ByCapability`` selection no client can ever match: a ConfigError naming the tags;
    FedBuff's options that cannot work with the job (:func:`.buffered.fedbuff_problems`)."""
    s: Any = job.strategy
    if getattr(s.client_selection, "method", None) == "ByCapability":
        try:
            select_clients(s.client_selection, num_clients=s.num_clients, round_idx=0, seed=job.run.seed,
                           client_tags=tags)
        except ValueError as e:
            raise ConfigError([("strategy.client_selection.required_tags", str(e).split(": ", 1)[-1])]) from None
    problems = fedbuff_problems(job, tags)
    if problems:
        raise ConfigError(problems)
