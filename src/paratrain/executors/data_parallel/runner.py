"""DataParallel: ``num_replicas`` processes, one disjoint data shard each, gradients
combined after every backward pass (DESIGN §4).

Sharding: every epoch a fresh permutation of the training rows, a pure function of
(seed, epoch) (the one Local uses) and so identical on every rank; replica ``r`` takes
``perm[:S*n][r::n]`` with ``S = N // n`` (as torch's DistributedSampler; the ``N mod n``
rows left over change each epoch). ``train.batch_size`` is per replica; a step of n
replicas therefore sees the concatenation of n batches -- exactly the rows of Local's
batch of ``n * batch_size`` at the same step -- and with ``AllReduce`` the update equals
single-process SGD on that concatenated batch (equal batch sizes make the mean of means
the global mean) and torch ``DistributedDataParallel``.

Aggregations (:mod:`.aggregation`): ``AllReduce`` (bucketed, overlapped with
backward), ``ParameterServer`` (rank 0 serves), ``Decentralized{ring|torus|complete}``
(gossip averaging of parameters; consensus distance per step). ``[compression]``
compresses what is exchanged.

Faults: each rank writes ``checkpoints/dp-rank<r>/ckpt-<step>.pt`` (model, optimizer,
RNG, position, aggregator/compressor state); after a barrier rank 0 writes
``checkpoints/dp-complete.json`` naming the step every rank has saved. A restart by the
elastic agent (or ``--resume``) loads that step on every rank, so a run killed midway
ends with the same parameters as an uninterrupted one. ``PARATRAIN_FAULT_KILL=RANK:STEP``
makes that rank SIGKILL itself after STEP on the first attempt (tests and demos).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...comm import collectives as C
from ...comm.context import WorkerContext
from ...comm.launch import in_torchrun, launch
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel
from ...data import load_data
from ...models import build_model
from ...training import (
    MetricsWriter,
    build_optimizer,
    checkpoint,
    epoch_permutation,
    evaluate,
    parameters_digest,
    prepare_run_dir,
    progress_bar,
    read_metrics,
    report,
    rng_state,
    seed_everything,
    set_rng_state,
    write_summary,
)
from ...training.faults import FAULT_ENV, maybe_kill
from ...training.resume import agree_on_checkpoint
from ...training.rundir import RunFolder, run_dir_of
from .aggregation import Aggregator, build_aggregator

__all__ = ["run", "worker_main", "train_replica", "shard_indices", "validate", "FAULT_ENV"]

_MARKER = "dp-complete.json"


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
    if num_train is not None and s.num_replicas > num_train:
        raise ConfigError([(
            "strategy.num_replicas",
            f"{s.num_replicas} replicas but only {num_train} training rows: each replica needs at least one",
        )])
    return s


_DATA_CACHE: dict[str, Any] = {}


def _load_data(job: JobConfig) -> Any:
    """load_data, memoised per process (tests and benchmarks train many jobs per rank)."""
    key = json.dumps([job.data.model_dump(mode="json"), job.run.seed], sort_keys=True)
    if key not in _DATA_CACHE:
        _DATA_CACHE.clear()
        _DATA_CACHE[key] = load_data(job.data, seed=job.run.seed)
    return _DATA_CACHE[key]


def _without_error_feedback(strategy: Any) -> Any:
    from ...config.compression import ClippedCompression, ErrorFeedback

    if isinstance(strategy, ErrorFeedback):
        return _without_error_feedback(strategy.base_strategy)
    if isinstance(strategy, ClippedCompression):
        return strategy.model_copy(update={"base_strategy": _without_error_feedback(strategy.base_strategy)})
    return strategy


def build_compressor(job: JobConfig, aggregation: Any = None, *, warn: bool = True) -> Any:
    """The job's gradient Compressor (None without ``[compression]``); Decentralized
    aggregation drops ErrorFeedback (CHOCO-gossip compensates the error itself)."""
    if job.compression is None or job.compression.method == "None":
        return None
    from ...compression import Compressor

    strategy = job.compression
    if getattr(aggregation, "method", None) == "Decentralized":
        stripped = _without_error_feedback(strategy)
        if stripped != strategy and warn:
            # CHOCO's public copies already carry the compression error to the next
            # round; a second residual on top double-counts it and diverges.
            warnings.warn(
                "compression: ErrorFeedback has no effect with Decentralized aggregation "
                "(CHOCO-gossip compensates the compression error itself); using its base strategy",
                stacklevel=2,
            )
        strategy = stripped
    return Compressor(strategy, seed=job.run.seed)


def _ckpt_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / "checkpoints" / f"dp-rank{rank}"


def _complete_step(run_dir: Path, world: int | None = None) -> int | None:
    """The step every rank has checkpointed; -2 when it was saved by another replica count."""
    marker = run_dir / "checkpoints" / _MARKER
    if not marker.exists():
        return None
    doc = json.loads(marker.read_text())
    if world is not None and int(doc.get("replicas", world)) != world:
        return -2
    return int(doc["step"])


def _agreed_step(ctx: WorkerContext, run_dir: Path) -> int | None:
    """Rank 0's last complete checkpoint step, broadcast (ranks may not share a disk)."""
    step = _complete_step(run_dir, ctx.world_size) if ctx.is_main else None
    value = -1 if step is None else step
    if ctx.world_size > 1:
        t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
        value = int(C.broadcast_(t, src=0, group=ctx.group).item())
    if value == -2:
        raise ConfigError([(
            "strategy.num_replicas",
            f"the checkpoints in {run_dir} were written by a different number of replicas; "
            f"resume with the original num_replicas or start without --resume",
        )])
    return None if value < 0 else value


def _barrier(ctx: WorkerContext) -> None:
    if ctx.world_size > 1:
        C.barrier(ctx.group)


def _all_mean(values: list[float], ctx: WorkerContext) -> list[float]:
    if ctx.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    C.all_reduce_(t, group=ctx.group)
    return (t / ctx.world_size).tolist()


def train_replica(
    ctx: WorkerContext, job: JobConfig, resume: bool = False, *, aggregation: Any = None,
    plot: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train this rank's replica; returns (model, summary). ``aggregation`` overrides the
    job's (``"NoSync"`` gives independent replicas, the tests' known-wrong variant)."""
    started = time.perf_counter()
    strategy = validate(job)
    if ctx.world_size != strategy.num_replicas:
        raise ConfigError([(
            "strategy.num_replicas",
            f"{strategy.num_replicas} replicas but the process group has {ctx.world_size} ranks",
        )])
    seed = job.run.seed
    seed_everything(seed)
    device = ctx.device
    bundle = _load_data(job)
    x_train, y_train = bundle.train.tensors
    n_rows = len(y_train)
    validate(job, num_train=n_rows)
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    model.to(device)
    counter = C.CommCounter()
    bucket_bytes = C.bucket_bytes_of(job.comm.bucket_size_mb)
    # Same seed gives the same init everywhere; the broadcast makes it true for any factory.
    C.broadcast_tensors(list(model.state_dict().values()), src=0, group=ctx.group,
                        bucket_bytes=bucket_bytes)
    opt = build_optimizer(model.parameters(), job.train.optimizer)
    agg: Aggregator = build_aggregator(
        aggregation if aggregation is not None else strategy.aggregation, model,
        group=ctx.group, counter=counter, bucket_bytes=bucket_bytes,
        compressor=build_compressor(job, strategy.aggregation if aggregation is None else aggregation,
                               warn=ctx.is_main),
        gamma=job.comm.gossip_step,
    )

    run_dir = run_dir_of(job)
    if ctx.is_main:
        prepare_run_dir(job, resume=resume)
    _barrier(ctx)
    metrics = MetricsWriter(run_dir) if ctx.is_main else None

    bs = job.train.batch_size
    shard = n_rows // ctx.world_size
    batches_per_epoch = math.ceil(shard / bs)
    total_steps = job.train.epochs * batches_per_epoch
    if job.train.max_steps is not None:
        total_steps = min(total_steps, job.train.max_steps)

    step, epoch, batch = 0, 0, 0
    # From the marker's step down to the newest one every rank can read (a bad file falls back).
    agreed = agree_on_checkpoint(_ckpt_dir(run_dir, ctx.rank), _agreed_step(ctx, run_dir) if resume else None,
                                 ctx.group if ctx.world_size > 1 else None)
    found = None if agreed is None else agreed[0]
    if agreed is not None:
        state = agreed[1]
        # a checkpoint of another model/optimizer: a ConfigError naming what differs (every
        # rank raises the same one, before anything is loaded or written)
        checkpoint.check_resume_state(model, opt, state,
                                      source=checkpoint.checkpoint_path(_ckpt_dir(run_dir, ctx.rank), agreed[0]))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        agg.load_state_dict(state["aggregator"])
        step, epoch, batch = int(state["step"]), int(state["epoch"]), int(state["batch"])
        for k, v in state["comm"].items():
            counter.bytes[k] = int(v)
        resumed_losses = [float(v) for v in state.get("losses", [])]
    else:
        resumed_losses = []
    if metrics is not None and resume:
        metrics.truncate_after("step", step)

    last_saved = [found]

    def save() -> None:
        d = _ckpt_dir(run_dir, ctx.rank)
        checkpoint.save_checkpoint(checkpoint.checkpoint_path(d, step), {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
            "aggregator": agg.state_dict(), "step": step, "epoch": epoch, "batch": batch,
            "comm": dict(counter.bytes), "losses": list(losses),
        })
        _barrier(ctx)  # every rank has saved `step` before it is declared complete
        if ctx.is_main:
            marker = run_dir / "checkpoints" / _MARKER
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "replicas": ctx.world_size}))
            os.replace(tmp, marker)
        _barrier(ctx)
        checkpoint.prune(d)
        last_saved[0] = step

    consensus: list[float] = []
    losses: list[float] = resumed_losses

    def log_eval() -> dict[str, float] | None:
        mean_loss = _all_mean([sum(losses) / max(len(losses), 1)], ctx)[0]
        losses.clear()
        if metrics is None:
            return None
        ev = evaluate(model, bundle.test, device=device)
        rec: dict[str, Any] = {
            "step": step, "epoch": epoch, "train_loss": mean_loss, "test_loss": ev["loss"],
            "test_accuracy": ev["accuracy"], "comm_bytes": counter.total_bytes,
            "time_s": time.perf_counter() - started,
        }
        if consensus:
            rec["consensus_distance"] = consensus[-1]
        metrics.log(rec)
        return ev

    model.train()
    ce, every = job.train.eval_every, job.run.checkpoint_every
    loss_fn = nn.functional.cross_entropy
    bar = progress_bar(enabled=None if ctx.is_main else False)
    task = bar.add_task(f"DataParallel x{ctx.world_size}", total=total_steps, completed=step, info="")
    bar.start()
    while step < total_steps and epoch < job.train.epochs:
        idx_all = shard_indices(n_rows, world=ctx.world_size, rank=ctx.rank, seed=seed, epoch=epoch)
        while batch < batches_per_epoch and step < total_steps:
            idx = idx_all[batch * bs : (batch + 1) * bs]
            x, y = x_train[idx].to(device), y_train[idx].to(device)
            opt.zero_grad(set_to_none=agg.zero_grad_set_to_none)
            loss = loss_fn(model(x), y)
            loss.backward()
            agg.sync_gradients()
            opt.step()
            extra = agg.after_step()
            losses.append(float(loss.detach()))
            step += 1
            batch += 1
            if "consensus_distance" in extra:
                consensus.append(extra["consensus_distance"])
                if metrics is not None:
                    metrics.log({"step": step, "consensus_distance": extra["consensus_distance"]})
            if batch == batches_per_epoch:
                epoch, batch = epoch + 1, 0
            end_of_epoch = batch == 0
            if (ce and step % ce == 0) or (not ce and end_of_epoch):
                ev = log_eval()
                if ev is not None:
                    bar.update(task, info=f"acc {ev['accuracy']:.3f}")
            bar.update(task, completed=step)
            if (every and step % every == 0) or (not every and end_of_epoch):
                save()
            maybe_kill(rank=ctx.rank, step=step, restart_count=ctx.restart_count)
            if end_of_epoch:
                break
    bar.stop()
    if losses:
        log_eval()
    if last_saved[0] != step:
        save()
    agg.close()

    bytes_total = C.CommCounter(bytes=dict(counter.bytes)).total_bytes
    steps_this_run = max(step, 1)
    summary: dict[str, Any] = {
        "strategy": "DataParallel",
        "aggregation": strategy.aggregation.method if aggregation is None else str(aggregation),
        "num_replicas": ctx.world_size,
        "backend": ctx.backend,
        "run_dir": str(run_dir),
        "steps": step,
        "epochs": epoch,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "comm_bytes_per_step": bytes_total / steps_this_run,
        "restart_count": ctx.restart_count,
        "parameters_sha256": parameters_digest(model),
    }
    if hasattr(agg, "topology"):
        summary["topology"] = agg.topology
    if consensus:
        summary["consensus_distance_first"] = consensus[0]
        summary["consensus_distance_last"] = consensus[-1]
    comp = getattr(agg, "compressor", None)
    if comp is not None:
        summary["compression"] = comp.stats.as_dict()
    if ctx.world_size > 1 and strategy.aggregation.method == "ParameterServer" and aggregation is None:
        sb = torch.tensor([float(getattr(agg, "server_bytes", 0))], dtype=torch.float64, device=device)
        C.broadcast_(sb, src=0, group=ctx.group)
        summary["server_bytes_per_step"] = float(sb.item()) / steps_this_run
    if ctx.is_main:
        final = evaluate(model, bundle.test, device=device)
        records = [r for r in read_metrics(run_dir) if r.get("test_accuracy") is not None]
        summary.update({
            "test_accuracy": final["accuracy"],
            "test_loss": final["loss"],
            "best_test_accuracy": max((r["test_accuracy"] for r in records), default=final["accuracy"]),
            "wall_time_s": round(time.perf_counter() - started, 3),
        })
        write_summary(run_dir, summary)
        if plot:  # never raises: a failed plot is a warning (report.never_fails)
            report.plot_curves(run_dir, title=f"{job.run.name} (DataParallel x{ctx.world_size})")
    return model, summary


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Entry of every DataParallel process (called by :mod:`paratrain.worker`)."""
    _, summary = train_replica(ctx, job, resume)
    return summary if ctx.is_main else None


def _warn_ineffective(job: JobConfig, strategy: DataParallel) -> None:
    """Warn once (in the launching process) about settings this run ignores."""
    method = strategy.aggregation.method
    compressed = job.compression is not None and job.compression.method != "None"
    if job.comm.gossip_step is not None and not (method == "Decentralized" and compressed):
        warnings.warn("comm.gossip_step has no effect: it applies to Decentralized aggregation "
                      "with compression (CHOCO-gossip)", stacklevel=3)
    if "bucket_size_mb" in job.comm.model_fields_set and (method != "AllReduce" or compressed):
        warnings.warn(f"comm.bucket_size_mb has no effect with {method}"
                      f"{' and compression' if compressed else ''}", stacklevel=3)


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Launch ``num_replicas`` processes and return rank 0's summary. Data and model are
    built here first; this (launching) process holds the run folder's lock."""
    strategy = validate(job)
    if not in_torchrun() or os.environ.get("RANK") == "0":
        _warn_ineffective(job, strategy)
    if not in_torchrun():
        # Fail before spawning anything (or touching the run folder) when the data
        # cannot feed every replica or the model cannot be built.
        bundle = _load_data(job)
        validate(job, num_train=len(bundle.train))
        build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare()
        summary = launch(job, nprocs=strategy.num_replicas, resume=resume)
    if summary is None:
        path = run_dir_of(job) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}
    return dict(summary)
