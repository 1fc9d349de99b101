"""Local: one process, the plain seeded training loop over the job's
:class:`~paratrain.task.Task` (the default strategy). Data order is a pure function of (seed,
epoch) and checkpoints hold the model, optimizer, RNG states and the position, so ``--resume``
after an interruption ends with bit-identical parameters.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from ..config.job import JobConfig
from ..data import DataBundle
from ..data.loader import LoaderOptions, dataset_rows
from ..models import build_model
from ..task import Task, resolve_task
from ..training import (
    MetricsWriter,
    build_optimizer,
    epoch_permutation,
    report,
    resolve_device,
    seed_everything,
    write_summary,
)
from ..training.gcfreeze import resume_collections
from ..training.loop import DataPlan, LocalEngine, LoopRun, Trainer, run_loop, summary_fields
from ..training.rundir import RunFolder
from ..training.stores import LocalStore, warm
from .spec import ExecutorSpec


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
    train, test = (data.train, data.test) if data is not None else the_task.datasets(seed)
    if model is not None:
        net = model
    elif data is not None:
        net = build_model(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
    else:
        net = the_task.build_model(job.model, train)
    if job.subgraphs:  # [subgraphs] keys against the model trained here (instances included)
        from ..subgraphs import check_pairings, check_paths

        check_pairings(job)
        check_paths(net, job)
    net.to(device)
    opt = build_optimizer(net.parameters(), job.train.optimizer)  # imports torch._dynamo
    resume_collections()  # the CLI's start-up is over (training.gcfreeze)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        return _train(job, folder, resume=folder.resume, net=net, opt=opt, task=the_task,
                      train=train, test=test, device=device, started=started)


def _train(
    job: JobConfig, folder: RunFolder, *, resume: bool, net: nn.Module, opt: Any,
    task: Task, train: Any, test: Any, device: Any, started: float,
) -> dict[str, Any]:
    run_dir = folder.path
    seed = job.run.seed
    n = dataset_rows(train)  # 0 for a stream: DataPlan.build counts its steps
    t = job.train
    plan = DataPlan.build(dataset=train, order=lambda e: epoch_permutation(n, seed=seed, epoch=e),
                          examples_per_epoch=n, batch_size=t.batch_size,
                          accumulation=t.grad_accumulation, epochs=t.epochs,
                          max_steps=t.max_steps, device=device,
                          loader=LoaderOptions.of(job.data, seed))
    engine = LocalEngine(net, task, test, device=device, precision=t.precision)
    trainer = Trainer(engine, opt, t, plan.total_steps)
    if not resume:  # the checkpoint's import overlaps the first steps (a resume loads at once)
        warm()
    result = run_loop(LoopRun(
        trainer=trainer, plan=plan, task=task, store=LocalStore(run_dir / "checkpoints"),
        label="Local", metrics=MetricsWriter(run_dir), resume=resume, prepare=folder.prepare,
        started=started, layout={"strategy": "Local", "replicas": 1}, **LoopRun.settings(job)))
    # metrics.jsonl is complete: a drawer process (the CLI's) draws while the summary is made
    drawing = report.draw_report(run_dir, title=f"{job.run.name} (Local)")
    summary: dict[str, Any] = {
        "strategy": "Local", "run_dir": str(run_dir),
        **summary_fields(result, task, train=train, test=test, model=net, started=started),
    }
    from ..training.export import save_model, whole_state

    save_model(run_dir, whole_state(net))  # `paratrain export` / paratrain.load_model
    write_summary(run_dir, summary)
    drawing.wait()  # report.png (drawn here, now, without a drawer)
    return summary


SPEC = ExecutorSpec(name="Local", run=run)  # one process; any Task, through the one loop
