"""DataParallel: ``num_replicas`` processes, one disjoint data shard each, gradients
combined after every backward pass (DESIGN §4; docs/data-parallel.md).

Replica ``r`` takes ``perm[:S*n][r::n]`` of every epoch's permutation, ``S = N // n`` (torch's
DistributedSampler; docs/data.md). ``train.batch_size`` is per replica, so a step of n
replicas sees the rows of Local's batch of ``n * batch_size``, and with ``AllReduce`` the
update equals single-process SGD on that batch (equal batch sizes make the mean of means the
global mean) and torch ``DistributedDataParallel``. A ``Local`` subgraph starts from rank 0's
parameters (the initial broadcast) and then takes only its replica's gradients. Every rank
writes its part of one checkpoint folder (prefix ``dp``), so a run killed midway and resumed
ends with an uninterrupted run's parameters.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...comm import buckets as B
from ...comm import collectives as C
from ...comm.context import WorkerContext
from ...comm.launch import launch
from ...comm.rendezvous import in_torchrun
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel
from ...data.loader import LoaderOptions, dataset_rows, is_stream
from ...subgraphs import local_buffer_names, local_parameter_names, local_paths
from ...task import resolve_task
from ...training import (
    MetricsWriter,
    build_optimizer,
    epoch_permutation,
    prepare_run_dir,
    report,
    seed_everything,
    write_summary,
)
from ...training.faults import FAULT_ENV as FAULT_ENV  # tests kill ranks through it
from ...training.loop import DataPlan, LocalEngine, LoopRun, Trainer, run_loop, summary_fields
from ...training.rundir import RunFolder, run_dir_of
from ...training.stores import RankStore
from ..entry import worker_entry
from ..shared.replicas import build_compressor
from ..shared.zero import ZeroEngine, check_shard
from .aggregation import Aggregator, DataParallelEngine, build_aggregator


def shard_indices(n: int, *, world: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """Replica ``rank``'s rows for ``epoch``: every ``world``-th row of the epoch
    permutation from ``rank`` on (as torch's DistributedSampler), the last ``n mod world``
    rows dropped so that shards are equal and disjoint."""
    size = n // world
    perm = epoch_permutation(n, seed=seed, epoch=epoch)
    return perm[: size * world][rank::world]


def validate(job: JobConfig, *, num_train: int | None = None) -> DataParallel:
    """The DataParallel strategy of ``job``; ConfigError for a bad replica count."""
    s = job.strategy
    if not isinstance(s, DataParallel):
        raise ConfigError([("strategy.type", f"expected DataParallel (got {getattr(s, 'type', s)!r})")])
    if s.num_replicas < 1:
        raise ConfigError([("strategy.num_replicas", f"must be >= 1 (got {s.num_replicas})")])
    check_shard(job, s)
    if num_train is not None and s.num_replicas > num_train:
        raise ConfigError([(
            "strategy.num_replicas",
            f"{s.num_replicas} replicas but only {num_train} training rows: each replica needs at least one",
        )])
    return s


def zero_world(job: JobConfig) -> int:
    """The processes ZeRO shards over: every replica, or under ``[fault_tolerance]`` the
    processes of one replica group (the groups replicate each other)."""
    fto, s = job.fault_tolerance, validate(job)
    return fto.processes_per_group if fto is not None else s.num_replicas


def shard_layout(job: JobConfig) -> list[str]:
    """``paratrain validate``: what ``strategy.shard`` shards, from the model built as a
    replica would (a ``shard_unit`` matching no module is a ConfigError here, before a launch)."""
    s = validate(job)
    if s.shard == "none":
        return []
    from ..shared.zero import shard_plan

    task, train, _ = _load_task(job)
    model = task.build_model(job.model, train)
    world = zero_world(job)
    plan = shard_plan(model, level=s.shard, units=s.shard_unit, local=local_parameter_names(model, job),
                      world=world)
    units = ", ".join(f"{u['unit']} ({u['elements_per_rank']} of {u['elements']})" for u in plan["units"])
    whole = f"; kept whole: {', '.join(plan['whole'])}" if plan["whole"] else ""
    over, who = ((f"{world} replicas", "a replica") if world == s.num_replicas
                 else (f"the {world} processes of each replica group", "a process"))
    return [f"ZeRO-{plan['zero_stage']} (shard = {s.shard}) over {over}, "
            f"elements {who} holds per unit: {units}{whole}; about "
            f"{plan['adam_fp32_bytes_per_rank']} bytes {who} for fp32 Adam"]


_DATA_CACHE: dict[str, Any] = {}


def _load_task(job: JobConfig) -> tuple[Any, Any, Any]:
    """``(task, train, test)`` of the job, memoised per process (tests and benchmarks
    train many jobs per rank)."""
    key = json.dumps([job.task.model_dump(mode="json"), job.data.model_dump(mode="json"),
                      job.model.model_dump(mode="json"), job.run.seed], sort_keys=True)
    if key not in _DATA_CACHE:
        _DATA_CACHE.clear()
        task = resolve_task(job)
        _DATA_CACHE[key] = (task, *task.datasets(job.run.seed))
    return _DATA_CACHE[key]  # type: ignore[no-any-return]


def _shared_buffers(model: nn.Module, job: JobConfig, strategy: DataParallel) -> list[torch.Tensor]:
    """The buffers rank 0 broadcasts before each step's first forward (``broadcast_buffers``,
    as torch DDP): all but those of Local subgraphs; none when it is off."""
    if not strategy.broadcast_buffers:
        return []
    own = local_buffer_names(model, job)
    return [b for n, b in model.named_buffers() if n not in own]


def _store(ctx: WorkerContext, run_dir: Path, shard: str = "none") -> RankStore:
    # ``shard`` in the layout: a checkpoint of pieces (ZeRO) and one of whole tensors are
    # different layouts even at one replica count, so a resume across them reshards
    return RankStore(run_dir, "dp", rank=ctx.rank, world=ctx.world_size, group=ctx.group,
                     layout={"replicas": ctx.world_size, "shard": shard},
                     layout_field="strategy.num_replicas",
                     device=ctx.device, reshard=True)


def train_replica(
    ctx: WorkerContext, job: JobConfig, resume: bool = False, *, plot: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train this rank's replica through the one loop; returns (model, summary)."""
    started = time.perf_counter()
    strategy = validate(job)
    if ctx.world_size != strategy.num_replicas:
        raise ConfigError([(
            "strategy.num_replicas",
            f"{strategy.num_replicas} replicas but the process group has {ctx.world_size} ranks",
        )])
    seed = job.run.seed
    seed_everything(seed)
    task, train, test = _load_task(job)
    n_rows = dataset_rows(train)  # 0 for a stream (its plan counts steps)
    validate(job, num_train=None if is_stream(train) else n_rows)
    model = task.build_model(job.model, train).to(ctx.device)
    counter = C.CommCounter()
    bucket_bytes = B.bucket_bytes_of(job.comm.bucket_size_mb)
    # Same seed gives the same init everywhere; the broadcast makes it true for any factory.
    B.broadcast_tensors(list(model.state_dict().values()), src=0, group=ctx.group,
                        bucket_bytes=bucket_bytes)
    local = local_parameter_names(model, job)  # Local subgraphs: never combined
    t = job.train
    zero, opt, agg = _aggregation(ctx, job, strategy, model, task, test, counter, local)
    run_dir = run_dir_of(job)
    plan = DataPlan.build(
        dataset=train, order=lambda e: shard_indices(n_rows, world=ctx.world_size, rank=ctx.rank,
                                                     seed=seed, epoch=e),
        examples_per_epoch=n_rows // ctx.world_size, batch_size=t.batch_size,
        accumulation=t.grad_accumulation, epochs=t.epochs, max_steps=t.max_steps, device=ctx.device,
        loader=LoaderOptions.of(job.data, seed), shard=(ctx.rank, ctx.world_size))
    engine: LocalEngine = zero if zero is not None else DataParallelEngine(
        model, task, test, ctx=ctx, precision=t.precision, agg=agg, counter=counter, local=local)
    trainer = Trainer(engine, opt, t, plan.total_steps)

    def prepare() -> None:
        if ctx.is_main:
            prepare_run_dir(job, resume=resume)
        if ctx.world_size > 1:
            C.barrier(ctx.group)

    try:
        result = run_loop(LoopRun(
            trainer=trainer, plan=plan, task=task, store=_store(ctx, run_dir, strategy.shard),
            label=f"DataParallel x{ctx.world_size}",
            metrics=MetricsWriter(run_dir) if ctx.is_main else None, resume=resume, prepare=prepare,
            rank=ctx.rank, restart_count=ctx.restart_count, started=started, group=ctx.group,
            layout={"strategy": "DataParallel", "replicas": ctx.world_size, "shard": strategy.shard},
            **LoopRun.settings(job)))
    finally:
        agg.close()
        if zero is not None:
            zero.close()
    held = zero.held_bytes(opt) if zero is not None else None  # measured before gathering
    if zero is not None:
        zero.gather_all()  # ZeRO-3: the whole model for the summary, the export and the caller

    summary = _summary(ctx, job, strategy, result, model, engine, agg, zero, held, counter,
                       task=task, train=train, test=test, started=started, local=local)
    if ctx.is_main:
        from ...training.export import save_model, whole_state

        # replica 0's model (every replica's under AllReduce; [subgraphs] Local layers: rank 0's)
        save_model(run_dir, whole_state(model))
        write_summary(run_dir, summary)
        if plot:  # never raises: a failed plot is a warning (report.never_fails)
            report.plot_curves(run_dir, title=f"{job.run.name} (DataParallel x{ctx.world_size})")
    return model, summary


def _aggregation(ctx: WorkerContext, job: JobConfig, strategy: Any, model: nn.Module, task: Any,
                 test: Any, counter: Any, local: Any) -> tuple[ZeroEngine | None, Any, Aggregator]:
    """ZeRO's engine (its optimizer steps this rank's pieces, :mod:`..shared.zero`) or the
    configured aggregation, and the optimizer over what this rank steps."""
    bucket_bytes = B.bucket_bytes_of(job.comm.bucket_size_mb)
    if strategy.shard != "none":
        zero = ZeroEngine(model, task, test, ctx=ctx, precision=job.train.precision, level=strategy.shard,
                          units=strategy.shard_unit, local=local, counter=counter,
                          buffers=_shared_buffers(model, job, strategy), bucket_bytes=bucket_bytes)
        opt = build_optimizer(zero.model.parameters(), job.train.optimizer)
        return zero, opt, Aggregator(model, group=ctx.group, counter=counter, local=local)
    opt = build_optimizer(model.parameters(), job.train.optimizer)
    agg = build_aggregator(
        strategy.aggregation, model,
        group=ctx.group, counter=counter, bucket_bytes=bucket_bytes,
        compressor=build_compressor(job, strategy.aggregation, warn=ctx.is_main),
        gamma=job.comm.gossip_step, local=local, buffers=_shared_buffers(model, job, strategy),
    )
    return None, opt, agg


def _summary(ctx: WorkerContext, job: JobConfig, strategy: Any, result: Any, model: nn.Module,
             engine: Any, agg: Any, zero: Any, held: Any, counter: Any, *, task: Any, train: Any,
             test: Any, started: float, local: Any) -> dict[str, Any]:
    """The run's summary (every rank makes it: the by-rank digests and the parameter
    server's bytes are collectives)."""
    run_dir = run_dir_of(job)
    steps_this_run = max(result.position.step, 1)
    summary: dict[str, Any] = {
        "strategy": "DataParallel",
        "aggregation": strategy.aggregation.method,
        "num_replicas": ctx.world_size,
        "backend": ctx.backend,
        "run_dir": str(run_dir),
        **summary_fields(result, task, train=train, test=test, model=model, started=started),
        "comm_bytes_per_step": counter.total_bytes / steps_this_run,
        "restart_count": ctx.restart_count,
    }
    if zero is not None:
        summary.update(zero.describe())
        summary["held_bytes"] = held
    if hasattr(agg, "topology"):
        summary["topology"] = agg.topology
    if local:
        summary["local_subgraphs"] = local_paths(job, model)  # patterns as the modules they matched
        summary["local_parameters"] = sorted(local)
        summary["parameters_sha256_by_rank"] = C.all_gather_text(summary["parameters_sha256"],
                                                                 group=ctx.group)
    if getattr(engine, "consensus", None):
        summary["consensus_distance_first"] = engine.consensus[0]
        summary["consensus_distance_last"] = engine.consensus[-1]
    comp = getattr(agg, "compressor", None)
    if comp is not None:
        summary["compression"] = comp.stats.as_dict()
    if ctx.world_size > 1 and strategy.aggregation.method == "ParameterServer":
        sb = torch.tensor([float(getattr(agg, "server_bytes", 0))], dtype=torch.float64, device=ctx.device)
        C.broadcast_(sb, src=0, group=ctx.group)
        summary["server_bytes_per_step"] = float(sb.item()) / steps_this_run
    return summary


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Entry of every DataParallel process (called by :mod:`paratrain.worker`)."""
    _, summary = train_replica(ctx, job, resume)
    return summary if ctx.is_main else None


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Launch ``num_replicas`` processes and return rank 0's summary. Data and model are
    built here first; this (launching) process holds the run folder's lock."""
    strategy = validate(job)
    if not in_torchrun():
        # Fail before spawning anything (or touching the run folder) when the data
        # cannot feed every replica or the model cannot be built.
        task, train, _ = _load_task(job)
        validate(job, num_train=None if is_stream(train) else len(train))
        task.build_model(job.model, train)
        shard_layout(job)  # ZeRO units resolve on the model (ConfigError before any launch)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare_launch()
        summary = launch(job, nprocs=strategy.num_replicas, resume=resume,
                         entry=worker_entry, target=worker_main)
    if summary is None:
        path = run_dir_of(job) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}
    return dict(summary)
