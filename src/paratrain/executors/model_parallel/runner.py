"""ModelParallel: the model's nodes placed on workers; activations/gradients move by protocol.

DESIGN §4. Every worker builds the same seeded model and keeps the nodes its
:class:`~.plan.Plan` assigns it (partitions by ``WorkerId``/``Tag``; uncovered nodes on
rank 0), as segments (maximal runs of consecutive nodes on one rank). Per batch of
``B`` rows:

- ``Direct``: one forward in graph order, activations sent point-to-point
  ``owner(S_j) -> owner(S_{j+1})``, then the backward in reverse with the gradient
  ``dL/da_j`` coming back; a rank may own several non-adjacent segments.
- ``Pipeline{micro_batch_size}``: each rank owns one segment (a stage); the batch is cut
  into micro-batches of ``micro_batch_size`` rows (last smaller) run with GPipe (Huang et
  al. 2019) or 1F1B/PipeDream-Flush (Narayanan et al. 2021); the extension field
  ``schedule`` picks one (default ``"1F1B"``).
- ``DataStore{path}``: as Direct, but every activation/gradient is a file in a shared
  directory (``path``, default ``<run dir>/datastore``): written atomically, consumed
  once, polled with a timeout.

The last stage computes ``sum_i sum_r CE / B`` over micro-batches, so loss and parameter
gradients equal the unpartitioned model's on the same batch; each rank then steps its
own optimizer over its own parameters (element-wise optimizers, so this equals one
optimizer over the whole model). Checkpoints are per rank
(``checkpoints/rank<r>/ckpt-<step>.pt``: its nodes' tensors, optimizer, RNG, position);
``--resume`` (or an elastic restart) restarts every rank from the newest step that all
ranks saved. ``PARATRAIN_FAULT_KILL=RANK:STEP`` makes that rank SIGKILL itself after STEP
on the first attempt (fault-injection for tests and demos, as for DataParallel).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ...comm.context import WorkerContext, default_workers
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import WorkerIdTarget
from ...data import load_data
from ...graph import nodes
from ...models import build_model
from ...training import (
    MetricsWriter,
    build_optimizer,
    checkpoint,
    epoch_permutation,
    prepare_run_dir,
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
from .plan import Plan, build_plan
from .runtime import StageRuntime, segment_modules
from .schedule import theoretical_bubble

__all__ = ["run", "validate", "worker_main", "num_workers", "plan_for", "FAULT_ENV"]

_EVAL_BATCH = 1024


def _digest(state: dict[str, torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for name in state:
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def num_workers(job: JobConfig) -> int:
    """Processes a ModelParallel job needs: ``[[workers]]`` count, else ``run.num_workers``,
    else one more than the highest ``worker-<k>`` a partition targets (at least 1)."""
    if job.workers:
        return len(job.workers)
    if job.run.num_workers is not None:
        return job.run.num_workers
    highest = 0
    strategy: Any = job.strategy
    for part in getattr(strategy, "partitions", []):
        if isinstance(part.target, WorkerIdTarget):
            m = re.fullmatch(r"worker-(\d+)", part.target.WorkerId)
            if m:
                highest = max(highest, int(m.group(1)))
    return highest + 1


def plan_for(job: JobConfig, model: torch.nn.Module, workers: list[Any]) -> Plan:
    """Validate the job's partitions against ``model`` and ``workers``; the placement."""
    strategy: Any = job.strategy
    if getattr(strategy, "type", None) != "ModelParallel":
        raise ConfigError([("strategy.type", f"expected ModelParallel (got {strategy.type!r})")])
    try:
        names = nodes(model)
    except TypeError as e:
        raise ConfigError([("model", f"ModelParallel needs a sequential model: {e}")]) from None
    pipeline = strategy.communication.protocol == "Pipeline"
    return build_plan(names, strategy.partitions, workers, contiguous=pipeline)


def validate(job: JobConfig) -> Plan:
    """The placement of ``job``'s partitions on its workers (``paratrain validate`` and
    ``run`` call this): builds the model to learn its node ids, then raises a
    ConfigError naming the culprit for every placement error DESIGN §4 lists."""
    n = num_workers(job)
    bundle = load_data(job.data, seed=job.run.seed)
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    return plan_for(job, model, default_workers(n, list(job.workers)))


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Validate the placement here, then run ``worker_main`` on every worker process
    (this launching process holds the run folder's lock)."""
    from ...comm.launch import launch

    validate(job)  # errors before any launch (and before the run folder changes)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare()
        summary = launch(job, nprocs=num_workers(job), resume=resume)
    if summary is None:  # under torchrun on a rank other than 0
        return {}
    result: dict[str, Any] = summary
    return result


def _prepare(ctx: WorkerContext, job: JobConfig, resume: bool) -> Path:
    """Rank 0 creates (or, fresh, clears) the run folder; the others wait for it."""
    key = "paratrain/model_parallel/run_dir_ready"
    if ctx.rank == 0:
        d = prepare_run_dir(job, resume=resume)
        if ctx.store is not None:
            ctx.store.set(key, "1")
        return d
    if ctx.store is not None:
        ctx.store.get(key)
    return run_dir_of(job)


def _transport(ctx: WorkerContext, job: JobConfig, run_dir: Path) -> Any:
    strategy: Any = job.strategy
    proto: Any = strategy.communication
    if proto.protocol == "DataStore":
        from ...comm.datastore import DataStoreTransport, open_session

        root = Path(proto.path) if proto.path else run_dir / "datastore"
        namespace = re.sub(r"[^A-Za-z0-9_\-]", "_", job.run.name)[:100] or "run"
        store = open_session(root, rank=ctx.rank, control=ctx.store, namespace=namespace,
                             generation=ctx.restart_count, timeout_s=job.comm.timeout_s)
        return DataStoreTransport(store, ctx.rank)
    from ...comm.p2p import P2PTransport

    return P2PTransport(ctx.group, device=ctx.device)


def pipeline_stats(totals: list[torch.Tensor], plan: Plan, *, micro_batches: int | None) -> dict[str, Any]:
    """Per-rank time split and the run's bubble fraction from each rank's step totals.

    ``bubble_fraction_measured = 1 - C_max / T``: ``C_max`` the busiest rank's forward/backward
    compute and ``T`` the longest rank's train-step time, summed over the run (GPipe's and
    Megatron's bubble, the time the pipeline's bottleneck stage stands idle). For a
    Pipeline, ``bubble_theory_modelled = (p - 1) / (m + p - 1)`` for ``p`` stages and ``m`` micro-
    batches of a full batch, the ideal with equal stages and free communication.
    """
    steps = max(float(totals[0][5]), 1.0)
    step_s = max(float(t[0]) for t in totals)
    busiest = max(float(t[1]) for t in totals)
    out: dict[str, Any] = {
        "stage_stats": [
            {"rank": r, "compute_fraction_measured": round(float(t[1]) / max(float(t[0]), 1e-12), 4),
             "blocked_in_recv_fraction_measured": round(float(t[2]) / max(float(t[0]), 1e-12), 4),
             "peak_activation_bytes_measured": int(t[3]),
             "bytes_sent_per_step_measured": round(float(t[4]) / steps, 1)}
            for r, t in enumerate(totals)
        ],
        "bubble_fraction_measured": round(1.0 - busiest / step_s, 4) if step_s > 0 else None,
    }
    if micro_batches is not None:
        out["bubble_theory_modelled"] = round(theoretical_bubble(plan.num_segments, micro_batches), 4)
    return out


def _common_step(ckpt_root: Path, world: int) -> int | None:
    """The newest step for which every rank has a checkpoint."""
    common: set[int] | None = None
    for r in range(world):
        d = ckpt_root / f"rank{r}"
        steps = {int(p.name[5:14]) for p in d.glob("ckpt-*.pt")} if d.is_dir() else set()
        common = steps if common is None else common & steps
    return max(common) if common else None


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Train this rank's segments; rank 0 logs metrics and returns the summary."""
    started = time.perf_counter()
    run_dir = _prepare(ctx, job, resume)
    seed = job.run.seed
    seed_everything(seed)
    bundle = load_data(job.data, seed=seed)
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    num_parameters = sum(p.numel() for p in model.parameters())
    plan = plan_for(job, model, ctx.workers)
    strategy: Any = job.strategy
    proto: Any = strategy.communication
    pipeline = proto.protocol == "Pipeline"
    modules = segment_modules(model, plan, ctx.rank)
    del model  # nodes other ranks own are freed; this rank keeps its segments only
    for m in modules.values():
        m.to(ctx.device)
    transport = _transport(ctx, job, run_dir)
    rt = StageRuntime(plan, ctx.rank, modules, transport, device=ctx.device)
    params = rt.parameters()
    opt = build_optimizer(params, job.train.optimizer) if params else None
    last = plan.last_rank
    if pipeline and ctx.rank == 0 and proto.micro_batch_size >= job.train.batch_size:
        warnings.warn(
            f"strategy.communication.micro_batch_size ({proto.micro_batch_size}) >= train.batch_size "
            f"({job.train.batch_size}): one micro-batch per batch, so the stages do not overlap",
            stacklevel=2,
        )

    ckpt_root = run_dir / "checkpoints"
    my_ckpts = ckpt_root / f"rank{ctx.rank}"
    x_train, y_train = bundle.train.tensors
    n = len(y_train)
    bs = job.train.batch_size
    per_epoch = math.ceil(n / bs)
    total = job.train.epochs * per_epoch
    if job.train.max_steps is not None:
        total = min(total, job.train.max_steps)
    metrics = MetricsWriter(run_dir) if ctx.rank == 0 else None

    step, epoch, batch = 0, 0, 0
    # From the newest common step down to the newest one every rank can read.
    agreed = agree_on_checkpoint(my_ckpts, _common_step(ckpt_root, ctx.world_size) if resume else None,
                                 ctx.group if ctx.world_size > 1 else None)
    found = None if agreed is None else agreed[0]
    if agreed is not None:
        state = agreed[1]
        for s, m in modules.items():
            m.load_node_state(state["nodes"])
            del s
        if opt is not None:
            opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        step, epoch, batch = int(state["step"]), int(state["epoch"]), int(state["batch"])
    if metrics is not None and resume:
        metrics.truncate_after("step", step)

    def save() -> None:
        node_state: dict[str, torch.Tensor] = {}
        for m in modules.values():
            node_state.update(m.node_state())
        checkpoint.save_checkpoint(
            checkpoint.checkpoint_path(my_ckpts, step),
            {"nodes": node_state, "optimizer": opt.state_dict() if opt is not None else {},
             "rng": rng_state(), "step": step, "epoch": epoch, "batch": batch},
        )
        checkpoint.prune(my_ckpts, keep=3)

    evals = 0

    def evaluate_test() -> dict[str, float] | None:
        """Forward the test set through the stages; rank 0 gets (loss, accuracy)."""
        nonlocal evals
        for m in modules.values():
            m.eval()
        x_all, y_all = bundle.test.tensors
        sums = torch.zeros(3, dtype=torch.float64)
        for i in range(0, len(y_all), _EVAL_BATCH):
            x, y = x_all[i:i + _EVAL_BATCH].to(ctx.device), y_all[i:i + _EVAL_BATCH].to(ctx.device)
            out = rt.forward(x, step=evals)
            evals += 1
            if out is not None:
                sums[0] += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
                sums[1] += int((out.argmax(dim=1) == y).sum())
                sums[2] += len(y)
        for m in modules.values():
            m.train()
        if last != 0:
            if ctx.rank == last:
                rt.send_metric(sums, dst=0, step=evals, slot=1)
            elif ctx.rank == 0:
                sums = rt.recv_metric(src=last, step=evals, slot=1).double()
        if ctx.rank != 0:
            return None
        count = max(float(sums[2]), 1.0)
        return {"loss": float(sums[0]) / count, "accuracy": float(sums[1]) / count}

    losses: list[float] = []
    step_times: list[float] = []
    # This rank's totals over its train steps: step, compute and blocked-in-recv seconds,
    # peak activation bytes, bytes sent, steps (gathered on rank 0 for the summary).
    totals = torch.zeros(6, dtype=torch.float64)
    every = job.run.checkpoint_every
    ce = job.train.eval_every
    while step < total and epoch < job.train.epochs:
        perm = epoch_permutation(n, seed=seed, epoch=epoch)
        while batch < per_epoch and step < total:
            idx = perm[batch * bs:(batch + 1) * bs]
            x, y = x_train[idx].to(ctx.device), y_train[idx].to(ctx.device)
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            w0, b0 = transport.wait_s, transport.bytes_sent
            loss = rt.train_step(
                x, y, step=step,
                micro_batch_size=proto.micro_batch_size if pipeline else None,
                schedule_name=proto.schedule if pipeline else None,
            )
            st = rt.stats
            totals += torch.tensor([st.step_s, st.compute_s, transport.wait_s - w0, 0.0,
                                    transport.bytes_sent - b0, 1.0], dtype=torch.float64)
            totals[3] = max(float(totals[3]), st.peak_activation_bytes)
            if opt is not None:
                opt.step()
            step_times.append(time.perf_counter() - t0)
            if last != 0 and ctx.rank == last:
                rt.send_metric(torch.tensor([loss or 0.0], dtype=torch.float64), dst=0, step=step)
            elif last != 0 and ctx.rank == 0:
                loss = float(rt.recv_metric(src=last, step=step)[0])
            if ctx.rank == 0 and loss is not None:
                losses.append(loss)
            step += 1
            batch += 1
            maybe_kill(rank=ctx.rank, step=step, restart_count=ctx.restart_count)
            if batch == per_epoch:
                epoch, batch = epoch + 1, 0
            end_of_epoch = batch == 0
            if (ce and step % ce == 0) or (not ce and end_of_epoch):
                ev = evaluate_test()
                if metrics is not None and ev is not None:
                    metrics.log({"step": step, "epoch": epoch,
                                 "train_loss": sum(losses) / max(len(losses), 1),
                                 "test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                                 "time_s": time.perf_counter() - started})
                losses = []
            if (every and step % every == 0) or (not every and end_of_epoch):
                save()
            if end_of_epoch:
                break
    save()
    final = evaluate_test()
    # parameters_sha256: sha256 over the per-rank digests of each rank's node tensors.
    own: dict[str, torch.Tensor] = {}
    for s_idx in sorted(modules):
        own.update(modules[s_idx].node_state())
    mine = torch.frombuffer(bytearray(_digest(own)), dtype=torch.uint8)
    digests, stage_totals = [mine], [totals]
    if ctx.rank != 0:
        rt.send_metric(mine, dst=0, step=step, slot=2)
        rt.send_metric(totals, dst=0, step=step, slot=3)
    else:
        for r in range(1, ctx.world_size):
            digests.append(rt.recv_metric(src=r, step=step, slot=2))
            stage_totals.append(rt.recv_metric(src=r, step=step, slot=3).double())
    transport.flush()
    if hasattr(transport, "close"):
        transport.close()
    if ctx.rank != 0 or final is None:
        return None
    if losses and metrics is not None:
        metrics.log({"step": step, "epoch": epoch, "train_loss": sum(losses) / len(losses),
                     "test_loss": final["loss"], "test_accuracy": final["accuracy"],
                     "time_s": time.perf_counter() - started})
    records = [r for r in read_metrics(run_dir) if r.get("test_accuracy") is not None]
    train_losses = [r["train_loss"] for r in records if r.get("train_loss") is not None]
    summary: dict[str, Any] = {
        "strategy": "ModelParallel",
        "protocol": proto.protocol,
        "schedule": proto.schedule if pipeline else None,
        "micro_batch_size": proto.micro_batch_size if pipeline else None,
        "run_dir": str(run_dir),
        "workers": ctx.world_size,
        "stages": [
            {"segment": s.index, "rank": s.rank, "worker": ctx.workers[s.rank].id,
             "nodes": list(s.nodes)}
            for s in plan.segments
        ],
        "steps": step,
        "epochs": epoch,
        "num_parameters": num_parameters,
        "final_train_loss": train_losses[-1] if train_losses else None,
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "best_test_accuracy": max((r["test_accuracy"] for r in records), default=final["accuracy"]),
        "median_step_time_s_measured": sorted(step_times)[len(step_times) // 2] if step_times else None,
        **pipeline_stats(stage_totals, plan, micro_batches=(
            math.ceil(bs / proto.micro_batch_size) if pipeline else None)),
        "parameters_sha256": hashlib.sha256(b"".join(d.numpy().tobytes() for d in digests)).hexdigest(),
        "restart_count": ctx.restart_count,
        "resumed_from_step": found,
        "wall_time_s": round(time.perf_counter() - started, 3),
    }
    summary["provenance"] = report.provenance(summary, configured=("micro_batch_size", "workers"))
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, title=f"{job.run.name} (ModelParallel/{proto.protocol})")
    return summary
