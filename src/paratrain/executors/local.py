"""Local: one process, the plain seeded training loop (the default strategy).

Data order is a pure function of (seed, epoch) and checkpoints hold the model,
optimizer, RNG states and the position (epoch, batch), so ``--resume`` after an
interruption ends with bit-identical parameters.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch import nn

from ..config.job import JobConfig
from ..data import DataBundle, load_data
from ..models import build_model
from ..training import (
    MetricsWriter,
    build_optimizer,
    checkpoint,
    epoch_permutation,
    evaluate,
    parameters_digest,
    progress_bar,
    read_metrics,
    report,
    resolve_device,
    rng_state,
    seed_everything,
    set_rng_state,
    train_step,
    write_summary,
)
from ..training.rundir import RunFolder

__all__ = ["run"]


def run(
    job: JobConfig, *, resume: bool = False, overwrite: bool = False,
    model: nn.Module | None = None, data: DataBundle | None = None,
) -> dict[str, Any]:
    """Train ``job`` in this process; ``model``/``data`` instances override the job's specs.

    Data, model and optimizer are built, and a resumed checkpoint is loaded and checked
    against them, before anything in the run folder changes (:class:`RunFolder`)."""
    started = time.perf_counter()
    seed = job.run.seed
    seed_everything(seed)
    device = resolve_device(job.run.device)
    bundle = data if data is not None else load_data(job.data, seed=seed)
    net = model if model is not None else build_model(
        job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes
    )
    net.to(device)
    opt = build_optimizer(net.parameters(), job.train.optimizer)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        return _train(job, folder, resume=folder.resume, net=net, opt=opt, bundle=bundle,
                      device=device, started=started)


def _train(
    job: JobConfig, folder: RunFolder, *, resume: bool, net: nn.Module, opt: Any,
    bundle: DataBundle, device: Any, started: float,
) -> dict[str, Any]:
    run_dir = folder.path
    ckpt_dir = run_dir / "checkpoints"
    seed = job.run.seed
    x_train, y_train = bundle.train.tensors
    n = len(y_train)
    bs = job.train.batch_size
    batches_per_epoch = math.ceil(n / bs)
    total_steps = job.train.epochs * batches_per_epoch
    if job.train.max_steps is not None:
        total_steps = min(total_steps, job.train.max_steps)

    step, epoch, batch = 0, 0, 0
    found = checkpoint.load_latest(ckpt_dir) if resume else None
    if found is not None:
        path, state = found
        checkpoint.check_model_state(net, state["model"], source=path)
        checkpoint.check_optimizer_state(opt, state["optimizer"], source=path,
                                         saved_type=state.get("optimizer_type"))
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        step, epoch, batch = int(state["step"]), int(state["epoch"]), int(state["batch"])
    folder.prepare()  # the first change on disk: everything above has been checked
    metrics = MetricsWriter(run_dir)
    if resume:
        metrics.truncate_after("step", step)

    def save() -> None:
        checkpoint.save_checkpoint(
            checkpoint.checkpoint_path(ckpt_dir, step),
            {"model": net.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
             "step": step, "epoch": epoch, "batch": batch, "optimizer_type": type(opt).__name__},
        )
        checkpoint.prune(ckpt_dir)

    def log_eval(train_losses: list[float]) -> dict[str, float]:
        ev = evaluate(net, bundle.test, device=device)
        metrics.log({
            "step": step, "epoch": epoch, "train_loss": sum(train_losses) / max(len(train_losses), 1),
            "test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
            "time_s": time.perf_counter() - started,
        })
        return ev

    ce = job.train.eval_every
    losses: list[float] = []
    net.train()
    with progress_bar() as bar:
        task = bar.add_task("Local", total=total_steps, completed=step, info="")
        while step < total_steps and epoch < job.train.epochs:
            perm = epoch_permutation(n, seed=seed, epoch=epoch)
            while batch < batches_per_epoch and step < total_steps:
                idx = perm[batch * bs : (batch + 1) * bs]
                x, y = x_train[idx].to(device), y_train[idx].to(device)
                losses.append(train_step(net, opt, x, y))
                step += 1
                batch += 1
                if batch == batches_per_epoch:
                    epoch, batch = epoch + 1, 0
                end_of_epoch = batch == 0
                if (ce and step % ce == 0) or (not ce and end_of_epoch):
                    ev = log_eval(losses)
                    losses = []
                    bar.update(task, info=f"acc {ev['accuracy']:.3f}")
                every = job.run.checkpoint_every
                if (every and step % every == 0) or (not every and end_of_epoch):
                    save()
                bar.update(task, completed=step)
                if end_of_epoch:
                    break
    if losses or not checkpoint.latest(ckpt_dir):
        log_eval(losses)
    save()
    final = evaluate(net, bundle.test, device=device)
    records = [r for r in read_metrics(run_dir) if r.get("test_accuracy") is not None]
    summary: dict[str, Any] = {
        "strategy": "Local",
        "run_dir": str(run_dir),
        "steps": step,
        "epochs": epoch,
        "num_parameters": sum(p.numel() for p in net.parameters()),
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "best_test_accuracy": max((r["test_accuracy"] for r in records), default=final["accuracy"]),
        "wall_time_s": round(time.perf_counter() - started, 3),
        "parameters_sha256": parameters_digest(net),
    }
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, title=f"{job.run.name} (Local)")
    return summary


