"""ModelParallel's launch and one rank's run (DESIGN §4, docs/model-parallel.md).

Every worker builds the same seeded task model, places and cuts it (:mod:`.validation`,
:mod:`.plan`), keeps its parts (:class:`~.engine.StageModel`) and trains them through the
one loop (:func:`paratrain.training.loop.run_loop`) with its own optimizer, over a
transport: ``P2PTransport`` (Direct, Pipeline) or a ``DataStore`` folder. Checkpoints are
per rank and resumable on another placement by the model's names (:func:`layout_of`); rank 0
gathers every rank's tensors for the exported model and writes the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from ...comm import collectives as C
from ...comm.buckets import bucket_bytes_of
from ...comm.context import WorkerContext
from ...comm.groups import new_group
from ...config import ConfigError
from ...config.job import JobConfig
from ...data.loader import LoaderOptions
from ...task.steps import example_args, model_args
from ...training import (
    MetricsWriter,
    build_optimizer,
    checkpoint,
    epoch_permutation,
    parameters_digest,
    prepare_run_dir,
    read_metrics,
    report,
    write_summary,
)
from ...training.export import complete_state, save_model, tied_names
from ...training.faults import FAULT_ENV as FAULT_ENV  # re-exported: tests inject faults by it
from ...training.loop import DataPlan, LoopRun, Trainer, run_loop, summary_fields
from ...training.rundir import RunFolder, run_dir_of
from ...training.stores import RankStore
from .engine import PipelineEngine, StageModel, pipeline_stats
from .plan import replicas_for
from .runtime import StageRuntime, held_attrs, segment_modules
from .tp_stages import (
    TPPipelineEngine,
    dense_own,
    lane_replicas,
    mesh_report,
    replica_groups,
    shard_model,
    tp_size_of,
)
from .validation import num_workers, plan_for, task_model, validate


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Validate the placement here, then run ``worker_main`` on every worker process
    (this launching process holds the run folder's lock)."""
    from ...comm.launch import launch
    from ..entry import worker_entry

    validate(job)  # errors before any launch (and before the run folder changes)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare_launch()
        summary = launch(job, nprocs=num_workers(job) * tp_size_of(job), resume=resume, entry=worker_entry,
                         target=worker_main)
    return summary or {}  # None: under torchrun on a rank other than 0


def _prepare(ctx: WorkerContext, job: JobConfig, resume: bool) -> Path:
    """Fresh run: rank 0 creates (or clears) the run folder, the others wait. On resume
    nothing is written until the checkpoint passed its check (:func:`_prepare_resumed`)."""
    if resume:
        return run_dir_of(job)
    key = "paratrain/model_parallel/run_dir_ready"
    if ctx.rank == 0:
        d = prepare_run_dir(job, resume=resume)
        if ctx.store is not None:
            ctx.store.set(key, "1")
        return d
    if ctx.store is not None:
        ctx.store.get(key)
    return run_dir_of(job)


def _prepare_resumed(ctx: WorkerContext, job: JobConfig) -> None:
    """The resume check passed on every rank: rank 0 writes job.json, the others wait."""
    if ctx.rank == 0:
        prepare_run_dir(job, resume=True)
    C.barrier(ctx.group)


@contextlib.contextmanager
def _transport(ctx: WorkerContext, job: JobConfig, run_dir: Path) -> Iterator[Any]:
    """The rank's transport, closed when the block ends; after an error aborted instead (its
    close flushes pending sends, which wait forever on a peer that failed)."""
    proto: Any = job.strategy.communication  # type: ignore[union-attr]
    transport: Any
    if proto.protocol == "DataStore":
        from ...comm.p2p import DataStoreTransport, open_session

        root = Path(proto.path) if proto.path else run_dir / "datastore"
        namespace = re.sub(r"[^A-Za-z0-9_\-]", "_", job.run.name)[:100] or "run"
        store = open_session(root, rank=ctx.rank, control=ctx.store, namespace=namespace,
                             run_dir=run_dir, generation=ctx.restart_count,
                             timeout_s=job.comm.timeout_s)
        transport = DataStoreTransport(store, ctx.rank)
    else:
        from ...comm.p2p import P2PTransport

        transport = P2PTransport(ctx.group, device=ctx.device)
    try:
        yield transport
    except BaseException:
        transport.abort()
        raise
    transport.close()


def _stage_setting(job: JobConfig, path: str | None, name: str, default: Any) -> Any:
    """A replicated stage's ``name`` on its ``[subgraphs.<path>]`` DataParallel
    (``broadcast_buffers``; ``shard``: ZeRO inside the stage, :class:`.engine.StageZero`)."""
    return getattr(job.subgraphs.get(path) if path is not None else None, name, default)


def _place(ctx: WorkerContext, job: JobConfig, model: Any, task: Any, train: Any,
           closing: contextlib.ExitStack) -> tuple[Any, ...]:
    """The model cut into parts and placed on the ranks: ``(model, plan, logical replicas,
    this rank's replicas, TP groups or None, this rank's replica group or None)``; with
    tensor parallelism (pipeline x TP, :mod:`.tp_stages`) the sharded model is cut, its TP
    groups closed with ``closing``."""
    tp = tp_size_of(job)
    tp_groups = None
    if tp > 1:
        n_logical = ctx.world_size // tp
        model, tp_groups, leaves = shard_model(job, model)
        closing.callback(tp_groups.tp.close)
        plan = plan_for(job, model, ctx.workers[:n_logical], example_args(task, train), leaves=leaves)
        logical = replicas_for(job, plan, n_logical)
        replicas = lane_replicas(logical, n_logical, tp, ctx.rank)
    else:
        plan = plan_for(job, model, ctx.workers, example_args(task, train))
        logical = replicas = replicas_for(job, plan, ctx.world_size)
    replica_group = None
    for ranks in replica_groups(logical, tp):  # with tp 1: each replicated stage's ranks
        group = new_group(ranks)  # every rank creates every group, in one order
        if ctx.rank in ranks:
            replica_group = group
    return model, plan, logical, replicas, tp_groups, replica_group


def layout_of(plan: Any, replicas: Any, world: int, shards: dict[str, str] | None = None) -> dict[str, Any]:
    """The run's processes and a digest of its placement (and of ZeRO-sharded stages); a
    checkpoint of another layout is resumed by the model's names."""
    where = [[s.index, s.rank, list(s.nodes)] for s in plan.segments]
    groups = {str(r): list(g) for r, g in sorted(replicas.groups.items())}
    sharded = {p: v for p, v in sorted((shards or {}).items()) if v != "none"}
    digest = hashlib.sha256(json.dumps([where, groups, *([sharded] if sharded else [])]).encode()).hexdigest()[:16]
    return {"strategy": "ModelParallel", "world": world, "placement": digest}


def gather_parts(rt: Any, own: dict[str, torch.Tensor], *, rank: int, world: int,
                 step: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's model tensors (by the model's names) on rank 0, in rank order (a
    replicated stage's replicas hold the same names and values: the first is kept)."""
    from safetensors.torch import load, save

    if rank != 0:
        blob = save({k: v.detach().cpu().contiguous().clone() for k, v in own.items()})
        rt.send_metric(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=0, step=step, slot=4)
        return []
    return [own] + [load(bytes(rt.recv_metric(src=r, step=step, slot=4).cpu().numpy().tobytes()))
                    for r in range(1, world)]


def _state_check(model: Any, opt: Any) -> Callable[[dict[str, Any], Any], None]:
    """A resumed state's check: the one loop's layout, this model and optimizer."""
    def check_state(state: dict[str, Any], source: Any) -> None:
        if "model" not in state:  # the per-node layout of versions before the one loop
            raise ConfigError([("run.name", (
                f"{source} was written by an earlier paratrain (per-node ModelParallel "
                f"checkpoints) and cannot be resumed; start the run without --resume"))])
        checkpoint.check_resume_state(model, opt, state, source=source)
    return check_state


def _data_plan(ctx: WorkerContext, job: JobConfig, train: Any) -> DataPlan:
    """Every rank walks the same batches (the loss part's rank reads the targets); a
    pipeline whose micro-batch is the whole batch is warned about (no overlap)."""
    t, proto = job.train, cast(Any, job.strategy).communication
    if proto.protocol == "Pipeline" and ctx.rank == 0 and proto.micro_batch_size >= t.batch_size:
        warnings.warn(
            f"strategy.communication.micro_batch_size ({proto.micro_batch_size}) >= train.batch_size "
            f"({t.batch_size}): one micro-batch per batch, so the stages do not overlap",
            stacklevel=3,
        )
    n, seed = len(train), job.run.seed
    return DataPlan(dataset=train, order=lambda e: epoch_permutation(n, seed=seed, epoch=e),
                    examples_per_epoch=n, batch_size=t.batch_size, accumulation=t.grad_accumulation,
                    epochs=t.epochs, max_steps=t.max_steps, device=ctx.device,
                    loader=LoaderOptions.of(job.data, seed))


def _engine(ctx: WorkerContext, job: JobConfig, rt: StageRuntime, stage: StageModel, task: Any,
            test: Any, replicas: Any, replica_group: Any, tp_groups: Any) -> PipelineEngine:
    """The rank's engine: its stage's schedule, replica sync (and ZeRO), TP where sharded."""
    proto: Any = job.strategy.communication  # type: ignore[union-attr]
    pipeline = proto.protocol == "Pipeline"
    where = replicas.paths.get(rt.rank)
    kw: dict[str, Any] = dict(
        precision=job.train.precision, micro_batch_size=proto.micro_batch_size if pipeline else None,
        schedule_name=proto.schedule if pipeline else None, replica_group=replica_group,
        broadcast_buffers=bool(_stage_setting(job, where, "broadcast_buffers", True)),
        bucket_bytes=bucket_bytes_of(job.comm.bucket_size_mb),
        shard=str(_stage_setting(job, where, "shard", "none")), where=where or "")
    if tp_groups is None:
        return PipelineEngine(ctx, rt, stage, task, test, **kw)
    return TPPipelineEngine(dataclasses.replace(ctx, rank=rt.rank), rt, stage, task, test,
                            groups=tp_groups, **kw)


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Train this rank's segments through the one loop; rank 0 logs metrics and returns
    the summary."""
    started = time.perf_counter()
    run_dir = _prepare(ctx, job, resume)
    task, train, test, model = task_model(job)
    num_parameters = sum(p.numel() for p in model.parameters())
    names, ties = list(model.state_dict()), tied_names(model)  # for the exported model
    tp = tp_size_of(job)
    with contextlib.ExitStack() as closing:  # the TP groups and the transport, on every path
        model, plan, logical, replicas, tp_groups, replica_group = _place(
            ctx, job, model, task, train, closing)
        stage_rank, _ = replicas.logical(ctx.rank)
        modules = segment_modules(model, plan, stage_rank)
        attrs = held_attrs(model, plan, stage_rank)
        del model  # nodes other ranks own are freed; this rank keeps its parts only
        stage = StageModel(modules, attrs, plan.segments_of(stage_rank)).to(ctx.device)
        transport = closing.enter_context(_transport(ctx, job, run_dir))
        rt = StageRuntime(plan, stage_rank, modules, transport, device=ctx.device, attrs=attrs,
                          replicas=replicas, physical_rank=ctx.rank,
                          feed=lambda batch: model_args(task, batch))
        data = _data_plan(ctx, job, train)
        engine = _engine(ctx, job, rt, stage, task, test, replicas, replica_group, tp_groups)
        # this rank's optimizer steps what the engine holds: its stage, or a ZeRO replica's rows
        opt = build_optimizer(engine.model.parameters(), job.train.optimizer)
        # the same on every rank: a lane's replica map is its own, the mesh is everyone's
        shards = {p: str(_stage_setting(job, p, "shard", "none")) for p in logical.paths.values()}
        layout = (layout_of(plan, replicas, ctx.world_size, shards) if tp == 1 else
                  {**layout_of(plan, logical, ctx.world_size, shards), "tp": tp})
        store = RankStore(run_dir, "mp", rank=ctx.rank, world=ctx.world_size, group=ctx.group,
                          layout=layout, layout_field="strategy.partitions", device=ctx.device,
                          reshard=True)
        result = run_loop(LoopRun(
            trainer=Trainer(engine, opt, job.train, data.total_steps), plan=data, task=task,
            store=store, label="ModelParallel",
            metrics=MetricsWriter(run_dir) if ctx.rank == 0 else None, resume=resume,
            check_state=_state_check(engine.model, opt),
            prepare=(lambda: _prepare_resumed(ctx, job)) if resume else None, rank=ctx.rank,
            restart_count=ctx.restart_count, started=started, group=ctx.group, layout=layout,
            **LoopRun.settings(job)))
        engine.record_held(opt)  # what a rank holds between steps
        engine.unshard()  # ZeRO-3 in a stage: whole parameters for the digest and the export
        own = dict(sorted(stage.node_state({a.name: a.target for a in plan.cut.attrs}).items()))
        if tp_groups is not None:  # the stage's dense tensors (every rank of the TP row: the same)
            own = dense_own(stage, own, tp_groups)
        stage_totals = [engine.totals]
        step = result.position.step
        if ctx.rank != 0:
            rt.send_metric(engine.totals, dst=0, step=step, slot=3)
        else:
            for r in range(1, ctx.world_size):
                stage_totals.append(rt.recv_metric(src=r, step=step, slot=3).double())
        parts = gather_parts(rt, own, rank=ctx.rank, world=ctx.world_size, step=step)
    if ctx.rank != 0 or result.final is None:
        return None
    whole = complete_state(parts, names, ties)  # every worker's part, one model
    summary = _summary(ctx, job, run_dir, result, engine, plan, logical, stage_totals, whole,
                       task=task, train=train, test=test, started=started,
                       num_parameters=num_parameters, resumed_from_step=store.loaded_step)
    save_model(run_dir, whole)
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, title=f"{job.run.name} (ModelParallel/{summary['protocol']})")
    return summary


def _summary(ctx: WorkerContext, job: JobConfig, run_dir: Path, result: Any, engine: PipelineEngine,
             plan: Any, logical: Any, stage_totals: list[Any], whole: dict[str, Any], *, task: Any,
             train: Any, test: Any, started: float, num_parameters: int,
             resumed_from_step: int | None) -> dict[str, Any]:
    """Rank 0's summary of the run: the stages, the pipeline's figures, the digest."""
    proto: Any = job.strategy.communication  # type: ignore[union-attr]
    pipeline = proto.protocol == "Pipeline"
    t = job.train
    tp = tp_size_of(job)
    records = [r for r in read_metrics(run_dir) if r.get("train_loss") is not None]
    step_times = engine.step_times
    summary: dict[str, Any] = {
        "strategy": "ModelParallel",
        "protocol": proto.protocol,
        "schedule": proto.schedule if pipeline else None,
        "micro_batch_size": proto.micro_batch_size if pipeline else None,
        "run_dir": str(run_dir),
        "workers": ctx.world_size,
        **({"tensor_parallel_size": tp, "mesh": mesh_report(logical, ctx.world_size // tp, tp),
            "tensor_parallel_shards_per_stage": len(engine.stage_shards())}
           if isinstance(engine, TPPipelineEngine) else {}),
        "stages": [
            {"segment": s.index, "rank": s.rank, "worker": ctx.workers[s.rank].id,
             "nodes": list(s.nodes),
             **({"replicas": [ctx.workers[r].id for r in logical.of(s.rank)]}
                if logical.count(s.rank) > 1 else {})}
            for s in plan.segments
        ],
        **summary_fields(result, task, train=train, test=test, model=None, started=started),
        "num_parameters": num_parameters,
        "final_train_loss": records[-1]["train_loss"] if records else None,
        "median_step_time_s_measured": sorted(step_times)[len(step_times) // 2] if step_times else None,
        **pipeline_stats(stage_totals, plan, micro_batches=(
            math.ceil(t.batch_size / proto.micro_batch_size) if pipeline else None),
            schedule=proto.schedule if pipeline else "1F1B"),
        "parameters_sha256": parameters_digest(whole),  # a Local run's, on equal parameters
        "restart_count": ctx.restart_count,
        "resumed_from_step": resumed_from_step,
    }
    summary["wall_time_s"] = round(time.perf_counter() - started, 3)
    summary["provenance"] = report.provenance(summary, configured=("micro_batch_size", "workers"))
    return summary
