"""Tensor parallelism as a job: ``tensor_parallel_size = tp`` under Local (``tp`` processes) or
DataParallel (``tp x num_replicas``; ZeRO over the dp column with ``shard``, :mod:`.zero`).
Ranks ``[d*tp, (d+1)*tp)`` form TP group ``d``, data-parallel replica ``d``; every rank builds
the same seeded full model and keeps its shard. Checkpoints name every tensor by the dense
model's name with its shard spec, so a run resumes on another size, or as a Local /
DataParallel run, and from theirs."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import torch

from ...comm.buckets import bucket_bytes_of
from ...comm.collectives import CommCounter, barrier, broadcast_module_
from ...comm.context import WorkerContext
from ...comm.launch import launch
from ...comm.rendezvous import in_torchrun
from ...comm.tp.groups import build_tp_groups
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel, Local
from ...config.tensor_parallel import TensorParallelismConfig
from ...data.loader import LoaderOptions, dataset_rows, is_stream
from ...task import job_model
from ...tensor_parallel import parallelize
from ...training import (
    MetricsWriter,
    build_optimizer,
    epoch_permutation,
    parameters_digest,
    prepare_run_dir,
    report,
    seed_everything,
    write_summary,
)
from ...training.loop import DataPlan, LoopRun, Trainer, run_loop, summary_fields
from ...training.rundir import RunFolder, run_dir_of
from ...training.stores import RankStore
from ..entry import worker_entry
from .engine import TensorParallelEngine
from .zero import MeshZeroEngine, mesh_units


def layout(job: JobConfig) -> tuple[TensorParallelismConfig, int, int]:
    """(config, tp, dp) of a tensor-parallel job; ConfigError when they cannot run."""
    cfg = job.tensor_parallel
    if cfg is None:
        raise ConfigError([("tensor_parallel", "missing: this executor runs [tensor_parallel] jobs")])
    s = job.strategy
    if isinstance(s, Local):
        dp = 1
    elif isinstance(s, DataParallel):
        if s.aggregation.method != "AllReduce":
            raise ConfigError([("strategy.aggregation.method",
                                f"tensor parallelism combines with DataParallel AllReduce only "
                                f"(got {s.aggregation.method!r})")])
        dp = s.num_replicas
        if s.shard != "none":  # ZeRO over the dp column of the mesh (.zero): AllReduce, uncompressed
            from ..shared.zero import check_shard

            check_shard(job, s)
    else:
        raise ConfigError([("strategy.type", f"tensor parallelism runs under Local or DataParallel "
                            f"(got {getattr(s, 'type', s)!r})")])
    if job.compression is not None and job.compression.method != "None" and dp == 1:
        raise ConfigError([("compression", "compresses the data-parallel gradient exchange, and this "
                            "job has one replica (tensor-parallel collectives carry activations "
                            "and are not compressed); add DataParallel replicas or drop it")])
    return cfg, cfg.tensor_parallel_size, dp


def _shard_of(job: JobConfig) -> str:
    """The DataParallel strategy's ZeRO level (``"none"`` for Local or unsharded)."""
    return str(getattr(job.strategy, "shard", "none"))


def dp_order(n: int, *, dp: int, replica: int, seed: int, epoch: int) -> torch.Tensor:
    """Replica ``replica``'s rows of ``epoch``: ``perm[: (n // dp) * dp][replica::dp]``
    (DataParallel's shard, the one loop's rule); the whole permutation for one replica."""
    perm = epoch_permutation(n, seed=seed, epoch=epoch)
    if dp == 1:
        return perm
    return perm[: (n // dp) * dp][replica::dp]


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Entry of every tensor-parallel process (rank 0 returns the summary)."""
    started = time.perf_counter()
    cfg, tp, dp = layout(job)
    _check_world(ctx, tp, dp)
    if job.train.precision == "bf16":  # bf16 matmuls in the parallel layers: TP's autocast
        cfg = cfg.model_copy(update={"mixed_precision": True})
    seed = job.run.seed
    seed_everything(seed)
    device = ctx.device
    task, train, test, model = job_model(job)
    n_rows = dataset_rows(train)  # 0 for a stream (its plan counts steps)
    if not is_stream(train) and n_rows // dp == 0:
        raise ConfigError([("strategy.num_replicas", f"{dp} replicas but only {n_rows} training rows")])
    model.to(device)
    broadcast_module_(model)  # one full model everywhere, then each rank keeps its shard
    dense_order = list(model.state_dict())  # the model's own order (conversion renames)
    groups = build_tp_groups(tp, pattern=cfg.communication_pattern.value,
                             async_op=cfg.async_communication,
                             fusion_threshold_bytes=cfg.fusion_threshold_bytes)
    shard = _shard_of(job)
    t = job.train
    tpm, zero = _parallelize(ctx, job, cfg, model, groups, task, test, shard=shard, dp=dp)
    opt = build_optimizer((zero.model if zero is not None else tpm).parameters(), job.train.optimizer)
    sync = tpm.grad_sync

    run_dir = run_dir_of(job)
    resuming = resume or ctx.restart_count > 0
    plan = _data_plan(job, train, n_rows, dp=dp, replica=groups.tp_index, device=device)
    engine: TensorParallelEngine | MeshZeroEngine = zero if zero is not None else TensorParallelEngine(
        tpm, task, test, device=device, precision=t.precision, micro_batches=cfg.micro_batches,
        is_main=ctx.is_main, backend=ctx.backend)
    trainer = Trainer(engine, opt, t, plan.total_steps)
    # ``shard`` in the layout: pieces of TP shards are another layout than whole TP shards
    store = RankStore(run_dir, "tp", rank=ctx.rank, world=ctx.world_size, group=ctx.group,
                      layout={"tp": tp, "dp": dp, **({"shard": shard} if zero is not None else {})},
                      layout_field="tensor_parallel.tensor_parallel_size",
                      device=device, reshard=True)

    def prepare() -> None:
        if ctx.is_main:
            prepare_run_dir(job, resume=resuming)
        barrier()

    label = f"TensorParallel x{tp}" + (f" x DataParallel x{dp}" if dp > 1 else "") + (
        f" (ZeRO shard = {shard} over dp)" if zero is not None else "")
    try:
        result = run_loop(LoopRun(
            trainer=trainer, plan=plan, task=task, store=store, label=label,
            metrics=MetricsWriter(run_dir) if ctx.is_main else None, resume=resuming,
            prepare=prepare, rank=ctx.rank, restart_count=ctx.restart_count, started=started,
            group=ctx.group, layout={"strategy": "TensorParallel", "tp": tp, "dp": dp, "replicas": dp,
                                     **({"shard": shard} if zero is not None else {})},
            **LoopRun.settings(job)))
        held = zero.held_bytes(opt) if zero is not None else None  # measured before gathering
        if zero is not None:
            zero.gather_all()  # ZeRO-3: the whole TP shards again (collective over dp)
        stats = tpm.statistics()
        dense = tpm.dense_state_dict()  # collective over the TP group
    finally:
        if zero is not None:
            zero.close()
        groups.tp.close()
    if not ctx.is_main:
        return None
    buffers = {n for n, _ in tpm.module.named_buffers()}
    num_parameters = sum(v.numel() for k, v in dense.items() if k not in buffers)
    dense = _with_tied_names(tpm, dense)
    dense = {**{k: dense[k] for k in dense_order if k in dense}, **dense}  # in the model's order
    from ...training.export import save_model

    save_model(run_dir, dense)  # dense, under the model's own names (tied ones too)
    summary = _summary(ctx, job, result, groups, stats, sync, dense, task=task, train=train,
                       test=test, started=started, shard=shard if zero is not None else None,
                       held=held, num_parameters=num_parameters)
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, title=f"{job.run.name} (tensor parallel x{tp}, dp x{dp})")
    return summary


def _check_world(ctx: WorkerContext, tp: int, dp: int) -> None:
    if ctx.world_size != tp * dp:
        raise ConfigError([("tensor_parallel.tensor_parallel_size",
                            f"tensor_parallel_size {tp} x {dp} replica(s) needs {tp * dp} processes "
                            f"but the process group has {ctx.world_size}")])


def _data_plan(job: JobConfig, train: Any, n_rows: int, *, dp: int, replica: int,
               device: torch.device) -> DataPlan:
    """This replica's batches: the TP ranks of one replica read the same rows."""
    t, seed = job.train, job.run.seed
    return DataPlan.build(dataset=train,
                          order=lambda e: dp_order(n_rows, dp=dp, replica=replica, seed=seed, epoch=e),
                          examples_per_epoch=n_rows if dp == 1 else n_rows // dp,
                          batch_size=t.batch_size, accumulation=t.grad_accumulation,
                          epochs=t.epochs, max_steps=t.max_steps, device=device,
                          loader=LoaderOptions.of(job.data, seed), shard=(replica, dp))


def _parallelize(ctx: WorkerContext, job: JobConfig, cfg: Any, model: Any, groups: Any, task: Any,
                 test: Any, *, shard: str, dp: int) -> tuple[Any, MeshZeroEngine | None]:
    """The tensor-parallel module, and with ZeRO over the dp column (no whole-gradient DP
    sync in the module then) its engine."""
    if shard == "none":
        opts: dict[str, Any] = {}
        if dp > 1:  # its compressor (each rank compresses its shard's gradients), DDP's buffers
            from ..shared.replicas import build_compressor

            opts = {"compressor": build_compressor(job),
                    "broadcast_buffers": bool(getattr(job.strategy, "broadcast_buffers", True))}
        return parallelize(model, cfg, groups, **opts), None
    tpm = parallelize(model, cfg, dataclasses.replace(groups, dp=None))
    zero = MeshZeroEngine(tpm, task, test, groups=groups, device=ctx.device, is_main=ctx.is_main,
                          world_group=ctx.group, precision=job.train.precision, level=shard,
                          units=getattr(job.strategy, "shard_unit", None),
                          micro_batches=cfg.micro_batches,
                          broadcast_buffers=bool(getattr(job.strategy, "broadcast_buffers", True)),
                          counter=CommCounter(), bucket_bytes=bucket_bytes_of(job.comm.bucket_size_mb))
    return tpm, zero


def _summary(ctx: WorkerContext, job: JobConfig, result: Any, groups: Any, stats: dict[str, Any],
             sync: Any, dense: dict[str, torch.Tensor], *, task: Any, train: Any, test: Any,
             started: float, shard: str | None, held: Any, num_parameters: int) -> dict[str, Any]:
    """Rank 0's summary: the mesh, the counted collectives, the digest of the dense model."""
    from ...training.export import MODEL_FILE

    _, tp, dp = layout(job)
    run_dir = run_dir_of(job)
    zero = shard is not None
    steps = max(result.position.step, 1)
    fields = summary_fields(result, task, train=train, test=test, model=None, started=started)
    wall = fields.pop("wall_time_s")
    summary: dict[str, Any] = {
        "strategy": "TensorParallel" if dp == 1 else "TensorParallel x DataParallel",
        "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "world_size": ctx.world_size,
        "mesh": groups.mesh.describe() if groups.mesh is not None else None,
        **({"shard": shard, "held_bytes": held} if zero else {}),
        "backend": ctx.backend,
        "run_dir": str(run_dir),
        **fields,
        "num_parameters": num_parameters,
        "communication_pattern": stats["communication_pattern"],
        **({"hierarchy": stats["hierarchy"]} if "hierarchy" in stats else {}),
        # counted at each torch.distributed call (CommStats): calls and handed bytes measured,
        # wire bytes by the ring cost model (the backend's algorithm is not visible)
        "collectives_measured": stats["collectives"],
        "collectives_per_step_measured": stats["total_collectives"] / steps,
        "payload_bytes_per_step_measured": stats["payload_bytes_measured"] / steps,
        "bytes_sent_per_step_modelled": stats["bytes_sent_modelled"] / steps,
        "communication_time_s_measured": stats["communication_time_s"],
        "computation_time_s_measured": stats["computation_time_s"],
        "param_bytes_local_measured": stats["param_bytes_local"],
        "param_bytes_dense_measured": stats["param_bytes_dense"],
        "memory_saving_measured": stats["memory_saving"],
        "restart_count": ctx.restart_count,
        "wall_time_s": wall,
        **({"dp_payload_bytes_sent_per_step_measured": sync.counter.total_bytes / steps}
           if sync is not None else {}),
        **({"compression": sync.compressor.stats.as_dict()}
           if sync is not None and sync.compressor is not None else {}),
        "dense_model": str(run_dir / MODEL_FILE),
        "parameters_sha256": parameters_digest(dense),
    }
    summary["provenance"] = report.provenance(
        summary, configured=("tensor_parallel_size", "data_parallel_size", "world_size"))
    return summary


def _with_tied_names(tpm: Any, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dense`` plus every other name of a tied (so replicated) parameter, as ``state_dict``
    lists it under each name and ``named_parameters`` once."""
    first: dict[int, str] = {}
    out = dict(dense)
    for name, p in tpm.module.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = name
        elif name not in out and first[id(p)] in out:
            out[name] = out[first[id(p)]]
    return out


def dry_module(job: JobConfig) -> Any:
    """The job's model sharded as rank 0 would, without processes or collectives."""
    from ...comm.tp.comm import TPComm
    from ...comm.tp.groups import TPGroups
    from ...tensor_parallel import TensorParallelModule

    cfg, tp, dp = layout(job)
    _, train, _, model = job_model(job)
    if not is_stream(train) and len(train) < dp:
        raise ConfigError([("strategy.num_replicas",
                            f"{dp} replicas but only {len(train)} training rows")])
    comm = TPComm(None, list(range(tp)), rank=0, pattern=cfg.communication_pattern.value)
    try:
        return TensorParallelModule(model, cfg, TPGroups(comm, None, tp, dp, 0))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError([("tensor_parallel", str(e))]) from None


def dry_run(job: JobConfig) -> list[tuple[str, str]]:
    """Shard the job's model as rank 0 would, so layout errors (heads not divisible, nothing
    to shard, a ZeRO ``shard_unit`` matching nothing...) surface before anything is launched;
    returns what was sharded and how (``paratrain validate`` and ``graph`` print it)."""
    tpm = dry_module(job)
    shard = _shard_of(job)
    if shard not in ("none", "optimizer"):
        mesh_units(tpm, getattr(job.strategy, "shard_unit", None))  # ConfigError: no such unit
    return list(tpm.layout())


def mesh_plan(job: JobConfig) -> dict[str, Any]:
    """The ``dp x tp`` mesh of a job (``paratrain graph`` / ``validate --explain``) and, with
    ZeRO, what rank 0 holds of its TP shard (units, elements, fp32 Adam bytes)."""
    from ...comm.mesh import Mesh
    from ..shared.zero import shard_plan

    _, tp, dp = layout(job)
    out: dict[str, Any] = {**Mesh.of(dp=dp, tp=tp).describe()}
    shard = _shard_of(job)
    if shard != "none":
        tpm = dry_module(job)
        units = mesh_units(tpm, getattr(job.strategy, "shard_unit", None)) if shard != "optimizer" else None
        out["zero"] = f"ZeRO (shard = {shard}) over dp on each TP shard"
        out["shard"] = shard_plan(tpm, level=shard, units=units, local=set(), world=dp)
    return out


def mesh_lines(job: JobConfig) -> list[str]:
    """``paratrain validate``'s lines for the mesh (a job with DataParallel replicas)."""
    m = mesh_plan(job)
    groups = "; ".join(f"{d} groups {g}" for d, g in m["groups"].items())
    lines = [f"mesh {' x '.join(f'{d} {n}' for d, n in zip(m['dims'], m['sizes'], strict=True))}: "
             f"{m['layout']}; {groups}"]
    if "shard" in m:
        z = m["shard"]
        units = ", ".join(f"{u['unit'].removeprefix('module.')} ({u['elements_per_rank']} of "
                          f"{u['elements']})" for u in z["units"])
        lines.append(f"{m['zero']}: ZeRO-{z['zero_stage']}, elements a rank holds per unit of "
                     f"tp rank 0's shard: {units}; about {z['adam_fp32_bytes_per_rank']} bytes a rank "
                     "for fp32 Adam")
    return lines


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Launch ``tensor_parallel_size x replicas`` processes; return rank 0's summary
    (this launching process holds the run folder's lock)."""
    _, tp, dp = layout(job)
    if not in_torchrun():
        dry_run(job)
    # the process limit (cores x 4, run.allow_oversubscribe) is paratrain.preflight's
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare_launch()
        summary = launch(job, nprocs=tp * dp, resume=resume, entry=worker_entry,
                         target=worker_main)
    if summary is None:
        path = run_dir_of(job) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}
    return dict(summary)
