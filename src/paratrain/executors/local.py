"""Local: one process, the plain seeded training loop (the default strategy).

Data order is a pure function of (seed, epoch) and checkpoints hold the model,
optimizer, RNG states and the position (epoch, batch), so ``--resume`` after an
interruption ends with bit-identical parameters.

What is trained is the job's :class:`~paratrain.task.Task` (``[task]``; classification by
default): its datasets, model, loss and metrics. A batch is gathered by index
(:func:`paratrain.task.fetch_batch`) in the order of ``epoch_permutation``; the summary
reports ``test_<metric>`` for every metric of the task, ``best_test_<fitness metric>``, and
the task's reference metrics (e.g. ``bigram_test_loss``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch import nn

from ..config.job import JobConfig
from ..data import DataBundle
from ..models import build_model
from ..task import Task, fetch_batch, resolve_task
from ..task import evaluate as evaluate_task
from ..task import train_step as task_train_step
from ..training import (
    MetricsWriter,
    build_optimizer,
    checkpoint,
    epoch_permutation,
    parameters_digest,
    progress_bar,
    read_metrics,
    report,
    resolve_device,
    rng_state,
    seed_everything,
    set_rng_state,
    write_summary,
)
from ..training.rundir import RunFolder

__all__ = ["run"]


def run(
    job: JobConfig, *, resume: bool = False, overwrite: bool = False,
    model: nn.Module | None = None, data: DataBundle | None = None, task: Task | None = None,
) -> dict[str, Any]:
    """Train ``job`` in this process; ``model``/``data``/``task`` instances override the
    job's specs (``data`` replaces the task's datasets).

    Data, model and optimizer are built, and a resumed checkpoint is loaded and checked
    against them, before anything in the run folder changes (:class:`RunFolder`)."""
    started = time.perf_counter()
    seed = job.run.seed
    seed_everything(seed)
    device = resolve_device(job.run.device)
    the_task = task if task is not None else resolve_task(job)
    train: Any
    test: Any
    if data is not None:
        train, test = data.train, data.test
    else:
        train, test = the_task.datasets(seed)
    if model is not None:
        net = model
    elif data is not None:
        net = build_model(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
    else:
        net = the_task.build_model(job.model, train)
    net.to(device)
    opt = build_optimizer(net.parameters(), job.train.optimizer)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        return _train(job, folder, resume=folder.resume, net=net, opt=opt, task=the_task,
                      train=train, test=test, device=device, started=started)


def _train(
    job: JobConfig, folder: RunFolder, *, resume: bool, net: nn.Module, opt: Any,
    task: Task, train: Any, test: Any, device: Any, started: float,
) -> dict[str, Any]:
    run_dir = folder.path
    ckpt_dir = run_dir / "checkpoints"
    seed = job.run.seed
    n = len(train)
    bs = job.train.batch_size
    batches_per_epoch = math.ceil(n / bs)
    total_steps = job.train.epochs * batches_per_epoch
    if job.train.max_steps is not None:
        total_steps = min(total_steps, job.train.max_steps)

    step, epoch, batch = 0, 0, 0
    found = checkpoint.load_latest(ckpt_dir) if resume else None
    if found is not None:
        path, state = found
        checkpoint.check_resume_state(net, opt, state, source=path)
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

    fit = task.fitness_metric
    evaluated: dict[int, dict[str, float]] = {}  # step -> metrics (the final eval reuses it)

    def log_eval(train_losses: list[float]) -> dict[str, float]:
        ev = evaluated[step] = evaluate_task(net, task, test, device=device)
        metrics.log({
            "step": step, "epoch": epoch, "train_loss": sum(train_losses) / max(len(train_losses), 1),
            **{f"test_{k}": v for k, v in ev.items()},
            "time_s": time.perf_counter() - started,
        })
        return ev

    ce = job.train.eval_every
    losses: list[float] = []
    net.train()
    with progress_bar() as bar:
        bar_task = bar.add_task("Local", total=total_steps, completed=step, info="")
        while step < total_steps and epoch < job.train.epochs:
            perm = epoch_permutation(n, seed=seed, epoch=epoch)
            while batch < batches_per_epoch and step < total_steps:
                idx = perm[batch * bs : (batch + 1) * bs]
                losses.append(task_train_step(net, opt, task, fetch_batch(train, idx, device)))
                step += 1
                batch += 1
                if batch == batches_per_epoch:
                    epoch, batch = epoch + 1, 0
                end_of_epoch = batch == 0
                if (ce and step % ce == 0) or (not ce and end_of_epoch):
                    ev = log_eval(losses)
                    losses = []
                    bar.update(bar_task, info=f"{fit} {ev.get(fit, float('nan')):.3f}")
                every = job.run.checkpoint_every
                if (every and step % every == 0) or (not every and end_of_epoch):
                    save()
                bar.update(bar_task, completed=step)
                if end_of_epoch:
                    break
    if losses or (step not in evaluated and not checkpoint.latest(ckpt_dir)):
        log_eval(losses)  # (a run whose last step was just evaluated logs no second record)
    save()
    final = evaluated.get(step) or evaluate_task(net, task, test, device=device)
    best = max if task.fitness_mode == "max" else min
    records = [r for r in read_metrics(run_dir) if r.get(f"test_{fit}") is not None]
    reference = getattr(task, "reference_metrics", None)
    summary: dict[str, Any] = {
        "strategy": "Local",
        "run_dir": str(run_dir),
        "steps": step,
        "epochs": epoch,
        "num_parameters": sum(p.numel() for p in net.parameters()),
        "task": str(getattr(task, "name", type(task).__name__)),
        **{f"test_{k}": v for k, v in final.items()},
        f"best_test_{fit}": best((r[f"test_{fit}"] for r in records), default=final.get(fit)),
        **(reference(train, test) if callable(reference) else {}),
        "wall_time_s": round(time.perf_counter() - started, 3),
        "parameters_sha256": parameters_digest(net),
    }
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, title=f"{job.run.name} (Local)")
    return summary


