"""Federated strategy (DESIGN §4): a server (rank 0) and ``num_clients`` logical clients
hosted many-per-worker, training any :class:`~paratrain.task.Task` on partitions of its
training set, in :func:`num_workers` processes (the elastic launcher; one: this process),
or on Flower's deployment runtime (``[federated] runtime = "flower"``, :mod:`.flower`).
"""
from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..spec import ExecutorSpec, GraphView, Traced, capped_workers


def worker_main(ctx: Any, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """:func:`.runner.worker_main`, imported when called: a Flower ClientApp imports this
    package for its light parts (SecAgg+'s key stages) and needs torch only to train."""
    from .runner import worker_main as main

    return main(ctx, job, resume)


def num_workers(job: JobConfig) -> int:
    """``run.num_workers`` (default 2), at most ``num_clients`` (preflight warns when it caps)."""
    strat: Any = job.strategy
    return int(min(job.run.num_workers or 2, strat.num_clients))


def run_in_process(job: JobConfig, *, resume: bool = False) -> dict[str, Any]:
    """The same round loop as one process (no process group; an in-memory store)."""
    import torch

    from ...comm.context import WorkerContext, default_workers
    from ...training import resolve_device

    ctx = WorkerContext(rank=0, world_size=1, device=resolve_device(job.run.device),
                        workers=default_workers(1, list(job.workers)))
    from ...training.threads import intra_op_threads, use_threads

    with use_threads(intra_op_threads(job) if ctx.device.type == "cpu" else torch.get_num_threads()):
        out = worker_main(ctx, job, resume)
    assert out is not None
    return out


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run a federated job and return its summary; this (launching) process builds data and
    model first and holds the run folder's lock."""
    from ...comm.launch import launch
    from ...comm.rendezvous import in_torchrun
    from ...config import ConfigError
    from ...training.rundir import RunFolder
    from ..entry import worker_entry
    from .flower.side import build_side

    if job.federated.runtime == "flower":  # the SuperLink starts its ServerApp (.flower)
        raise ConfigError([("federated.runtime", (
            'runtime = "flower" runs on Flower\'s deployment runtime: start a SuperLink and '
            "SuperNodes and `flwr run examples/federated_flower <connection> --run-config "
            "'job=\"<this job file>\"'` (examples/federated_flower/README.md); set runtime = "
            '"local" to run it here'))])
    n = num_workers(job)
    if not in_torchrun():  # fail before the run folder changes
        build_side(job)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare_launch()
        if n == 1:
            return run_in_process(job, resume=resume)
        out: dict[str, Any] = launch(job, nprocs=n, resume=resume, entry=worker_entry,
                                     target=worker_main)
    return out


def _notes(job: JobConfig) -> list[str]:
    """``run.num_workers`` above ``num_clients`` is capped (:func:`num_workers`)."""
    strat: Any = job.strategy
    clients = int(strat.num_clients)
    return capped_workers(job, clients, f"{clients} clients", " (a worker without a client has nothing to do)")


def _check_data(job: JobConfig, bundle: Any) -> None:
    """:func:`.checks.check_data`, imported when called (see :func:`worker_main`)."""
    from .checks import check_data

    check_data(job, bundle)


def _runtime(job: JobConfig) -> str:
    """Which path runs the rounds (``[federated] runtime``)."""
    if job.federated.runtime == "flower":
        return ("Flower's Deployment Runtime: `flwr run` paratrain's app (examples/federated_flower) "
                "against a SuperLink; SuperNode partition-id p of num-partitions P hosts the clients "
                "c % P == p")
    return f"the local path: `paratrain run`, {num_workers(job)} worker process(es) over torch.distributed"


def _describe(job: JobConfig) -> list[str]:
    """``paratrain validate``'s lines: which path runs the rounds, ``[federated.dp]``'s effect."""
    from .privacy import dp_lines

    return [f"runs on {_runtime(job)}", *dp_lines(job)]


def _graph(traced: Traced) -> GraphView:
    """``paratrain graph``'s ``runtime``: which path runs the rounds."""
    return GraphView(lambda: {"runtime": _runtime(traced.job)})


# any Task: clients train through training.loop.Trainer
SPEC = ExecutorSpec(name="Federated", run=run, processes=lambda job: (num_workers(job), "run.num_workers"),
                    notes=_notes, check_data=_check_data, describe=_describe, graph=_graph)
