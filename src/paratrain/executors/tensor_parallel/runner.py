"""Tensor parallelism as a job: ``[tensor_parallel] tensor_parallel_size = tp`` with a
Local strategy (``tp`` processes) or DataParallel (``tp x num_replicas`` processes, 2-D).

Layout: ranks ``[d*tp, (d+1)*tp)`` form tensor-parallel group ``d`` (= data-parallel
replica ``d``); every rank builds the same seeded full model and keeps its shard
(:func:`paratrain.tensor_parallel.parallelize`). Each epoch the training rows are permuted
by (seed, epoch) and replica ``d`` takes the contiguous slice ``d`` of ``N // dp`` rows; the
ranks of one TP group see the same batches. A step is
:func:`paratrain.tensor_parallel.train_step` (``micro_batches`` from the config; DP gradients
averaged once per step with ``gradient_accumulation``, per micro-batch otherwise).

Checkpoints: each rank writes ``checkpoints/tp-rank<r>/ckpt-<step>.pt`` (its shard, its
optimizer state, RNG, position); after a barrier rank 0 writes ``tp-complete.json``.
``--resume`` or an elastic restart loads the agreed step everywhere. At the end the full
model is gathered and rank 0 writes ``model.pt`` (the dense state dict, loadable into the
unsharded model) and ``summary.json`` with the tensor-parallel statistics.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...comm.context import WorkerContext
from ...comm.launch import in_torchrun, launch
from ...comm.tp_ops import (
    broadcast_int,
    broadcast_module_,
    build_tp_groups,
    world_barrier,
    world_mean,
)
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel, Local
from ...config.tensor_parallel import TensorParallelismConfig
from ...data import load_data
from ...models import build_model
from ...tensor_parallel import parallelize, train_step
from ...training import (
    MetricsWriter,
    build_optimizer,
    checkpoint,
    epoch_permutation,
    evaluate,
    prepare_run_dir,
    read_metrics,
    report,
    rng_state,
    seed_everything,
    set_rng_state,
    write_summary,
)
from ...training.resume import agree_on_checkpoint
from ...training.rundir import RunFolder, run_dir_of

__all__ = ["run", "validate", "worker_main", "layout", "dry_run"]

_MARKER = "tp-complete.json"


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
    else:
        raise ConfigError([("strategy.type", f"tensor parallelism runs under Local or DataParallel "
                            f"(got {getattr(s, 'type', s)!r})")])
    if job.compression is not None and job.compression.method != "None" and dp == 1:
        raise ConfigError([("compression", "compresses the data-parallel gradient exchange, and this "
                            "job has one replica (tensor-parallel collectives carry activations "
                            "and are not compressed); add DataParallel replicas or drop it")])
    return cfg, cfg.tensor_parallel_size, dp


def _compressed_dp(job: JobConfig, tpm: Any, groups: Any) -> Any:
    """With ``[compression]``, the data-parallel gradient average runs compressed.

    Each rank compresses its shard's gradients (keyed by parameter name, the same on
    every replica of a TP index), all-gathers the payloads over its data-parallel group,
    decodes and averages them: DataParallel's compressed AllReduce, on the DP group.
    Error-feedback residuals are per rank and go into its checkpoint."""
    if groups.dp is None:
        return None
    from ...comm.collectives import CommCounter
    from ..data_parallel.aggregation import AllReduceAgg
    from ..data_parallel.runner import build_compressor

    comp = build_compressor(job)
    if comp is None:
        return None
    agg = AllReduceAgg(tpm, group=groups.dp.group, counter=CommCounter(), bucket_bytes=0,
                       compressor=comp)
    tpm.dp_sync = agg.sync_gradients
    return agg


def _ckpt_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / "checkpoints" / f"tp-rank{rank}"


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Entry of every tensor-parallel process (rank 0 returns the summary)."""
    started = time.perf_counter()
    cfg, tp, dp = layout(job)
    if ctx.world_size != tp * dp:
        raise ConfigError([("tensor_parallel.tensor_parallel_size",
                            f"tensor_parallel_size {tp} x {dp} replica(s) needs {tp * dp} processes "
                            f"but the process group has {ctx.world_size}")])
    seed = job.run.seed
    seed_everything(seed)
    device = ctx.device
    bundle = load_data(job.data, seed=seed)
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    model.to(device)
    broadcast_module_(model)  # one full model everywhere, then each rank keeps its shard
    groups = build_tp_groups(tp, pattern=cfg.communication_pattern.value,
                             async_op=cfg.async_communication,
                             fusion_threshold_bytes=cfg.fusion_threshold_bytes)
    tpm = parallelize(model, cfg, groups)
    opt = build_optimizer(tpm.parameters(), job.train.optimizer)
    agg = _compressed_dp(job, tpm, groups)

    run_dir = run_dir_of(job)
    if ctx.is_main:
        prepare_run_dir(job, resume=resume)
    world_barrier()
    metrics = MetricsWriter(run_dir) if ctx.is_main else None

    x_train, y_train = bundle.train.tensors
    n_rows = len(y_train)
    shard = n_rows // dp
    if shard == 0:
        raise ConfigError([("strategy.num_replicas", f"{dp} replicas but only {n_rows} training rows")])
    bs = job.train.batch_size
    batches_per_epoch = math.ceil(shard / bs)
    total_steps = job.train.epochs * batches_per_epoch
    if job.train.max_steps is not None:
        total_steps = min(total_steps, job.train.max_steps)

    step, epoch, batch = 0, 0, 0
    marker = run_dir / "checkpoints" / _MARKER
    found = None
    if resume or ctx.restart_count > 0:
        mine = int(json.loads(marker.read_text())["step"]) if ctx.is_main and marker.exists() else None
        found = broadcast_int(mine, device=device if ctx.backend == "nccl" else None)
    # From the marker's step down to the newest one every rank can read (a bad file falls back).
    agreed = agree_on_checkpoint(_ckpt_dir(run_dir, ctx.rank), found, ctx.group if ctx.world_size > 1 else None)
    found = None if agreed is None else agreed[0]
    if agreed is not None:
        state = agreed[1]
        checkpoint.check_resume_state(tpm, opt, state,
                                      source=checkpoint.checkpoint_path(_ckpt_dir(run_dir, ctx.rank), agreed[0]))
        tpm.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if agg is not None:
            agg.load_state_dict(state.get("aggregator", {}))
        set_rng_state(state["rng"])
        step, epoch, batch = int(state["step"]), int(state["epoch"]), int(state["batch"])
    if metrics is not None and (resume or ctx.restart_count > 0):
        metrics.truncate_after("step", step)

    last_saved = [found]

    def save() -> None:
        d = _ckpt_dir(run_dir, ctx.rank)
        checkpoint.save_checkpoint(checkpoint.checkpoint_path(d, step), {
            "model": tpm.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
            "step": step, "epoch": epoch, "batch": batch,
            "aggregator": agg.state_dict() if agg is not None else {}})
        world_barrier()
        if ctx.is_main:
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "tp": tp, "dp": dp}))
            os.replace(tmp, marker)
        world_barrier()
        checkpoint.prune(d)
        last_saved[0] = step

    losses: list[float] = []
    red_dev = device if ctx.backend == "nccl" else None

    def log_eval() -> dict[str, float]:
        mean_loss = world_mean([sum(losses) / max(len(losses), 1)], red_dev)[0]
        losses.clear()
        ev = evaluate(tpm, bundle.test, device=device)  # collective: every rank runs it
        if metrics is not None:
            st = tpm.statistics()
            metrics.log({"step": step, "epoch": epoch, "train_loss": mean_loss,
                         "test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                         "collectives": st["total_collectives"],
                         "payload_bytes_measured": st["payload_bytes_measured"],
                         "bytes_sent_modelled": st["bytes_sent_modelled"],
                         "time_s": time.perf_counter() - started})
        return ev

    tpm.train()
    ce, every = job.train.eval_every, job.run.checkpoint_every
    d_index = groups.tp_index
    loss_fn = nn.functional.cross_entropy
    while step < total_steps and epoch < job.train.epochs:
        perm = epoch_permutation(n_rows, seed=seed, epoch=epoch)[d_index * shard:(d_index + 1) * shard]
        while batch < batches_per_epoch and step < total_steps:
            idx = perm[batch * bs:(batch + 1) * bs]
            x, y = x_train[idx].to(device), y_train[idx].to(device)
            losses.append(train_step(tpm, x, y, loss_fn, opt, micro_batches=cfg.micro_batches))
            step += 1
            batch += 1
            if batch == batches_per_epoch:
                epoch, batch = epoch + 1, 0
            end_of_epoch = batch == 0
            if (ce and step % ce == 0) or (not ce and end_of_epoch):
                log_eval()
            if (every and step % every == 0) or (not every and end_of_epoch):
                save()
            if end_of_epoch:
                break
    if losses:
        log_eval()
    if last_saved[0] != step:
        save()

    stats = tpm.statistics()
    final = evaluate(tpm, bundle.test, device=device)
    dense = tpm.dense_state_dict()  # collective over the TP group
    groups.tp.close()
    if not ctx.is_main:
        return None
    checkpoint.save_checkpoint(run_dir / "model.pt", dense)
    records = [r for r in read_metrics(run_dir) if r.get("test_accuracy") is not None]
    steps = max(step, 1)
    summary: dict[str, Any] = {
        "strategy": "TensorParallel" if dp == 1 else "TensorParallel x DataParallel",
        "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "run_dir": str(run_dir),
        "steps": step,
        "epochs": epoch,
        "num_parameters": sum(t.numel() for t in dense.values()),
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "best_test_accuracy": max((r["test_accuracy"] for r in records), default=final["accuracy"]),
        "communication_pattern": stats["communication_pattern"],
        **({"hierarchy": stats["hierarchy"]} if "hierarchy" in stats else {}),
        # counted at each torch.distributed call (comm/tp_ops.py CommStats): the calls and
        # the bytes of the tensors this rank handed to them are measured; the bytes it puts
        # on the wire follow the ring cost model (the backend's algorithm is not visible)
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
        "wall_time_s": round(time.perf_counter() - started, 3),
        **({"compression": agg.compressor.stats.as_dict(),
            "dp_payload_bytes_sent_per_step_measured": agg.counter.total_bytes / steps}
           if agg is not None else {}),
        "dense_model": str(run_dir / "model.pt"),
        "parameters_sha256": _digest(dense),
    }
    summary["provenance"] = report.provenance(
        summary, configured=("tensor_parallel_size", "data_parallel_size", "world_size"))
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, title=f"{job.run.name} (tensor parallel x{tp}, dp x{dp})")
    return summary


def _digest(state: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dry_run(job: JobConfig) -> None:
    """Shard the job's model as rank 0 would, without processes or collectives, so layout
    errors (heads not divisible, BlockWise on a square size, nothing to shard...) surface
    before anything is launched."""
    from ...comm.tp_ops import TPComm, TPGroups
    from ...tensor_parallel import TensorParallelModule

    cfg, tp, dp = layout(job)
    bundle = load_data(job.data, seed=job.run.seed)
    if len(bundle.train) < dp:
        raise ConfigError([("strategy.num_replicas",
                            f"{dp} replicas but only {len(bundle.train)} training rows")])
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    comm = TPComm(None, list(range(tp)), rank=0, pattern=cfg.communication_pattern.value)
    try:
        TensorParallelModule(model, cfg, TPGroups(comm, None, tp, dp, 0))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError([("tensor_parallel", str(e))]) from None


def validate(job: JobConfig) -> None:
    """``paratrain validate``: the layout checks ``run`` does before launching."""
    dry_run(job)


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Launch ``tensor_parallel_size x replicas`` processes; return rank 0's summary
    (this launching process holds the run folder's lock)."""
    _, tp, dp = layout(job)
    if not in_torchrun():
        dry_run(job)
    # the process limit (cores x 4, run.allow_oversubscribe) is paratrain.preflight's
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare()
        summary = launch(job, nprocs=tp * dp, resume=resume)
    if summary is None:
        path = run_dir_of(job) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}
    return dict(summary)
