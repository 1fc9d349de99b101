"""PopulationBased: population-based training (Jaderberg et al. 2017) over worker processes.

Member ``i`` trains on rank ``i mod W``. Each generation (Algorithm 1 of the paper, with a
synchronous "ready" point): rank 0 broadcasts the plan (every member's hyperparameters and
*source*); every rank trains its members (:mod:`.member`) and writes each one's file
``checkpoints/gen-<g>/member-<i>.pt``, through which members move between ranks (so
``run.output_dir`` must be shared: every rank checks); rank 0 gathers the results, runs
exploit/explore (:mod:`.pbt`) and writes ``lineage.json``; then the run's lifecycle
checkpoints the generation (kind ``pbt``: the population on process 0, each process's
members as ``engine/rank<r>``). A resume, on any number of workers, writes the member files
again from it and ends as an uninterrupted run would: all randomness is a function of the
seed, the member and the generation. A member that fails before it ever saved a state (in
generation 0, or sourced from such a member) reports its first failure in every later
generation it cannot run (a record's ``lost``, so a resume knows them too).
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from ...comm.collectives import barrier, broadcast_json, gather_json
from ...comm.context import WorkerContext, default_workers
from ...config import ConfigError
from ...config.job import JobConfig
from ...files import write_json, write_text
from ...training import (
    MetricsWriter,
    checkpoint,
    parameters_digest,
    prepare_run_dir,
    resolve_device,
    write_summary,
)
from ...training.faults import maybe_kill
from ...training.lifecycle import Lifecycle, engine_state
from ...training.rundir import RunFolder, run_dir_of, safe_rmtree
from ...training.stores import RankStore
from .member import MemberRunner, member_path, task_name, validate_job
from .pbt import PopulationState, ancestry, lineage_json
from .report import plot_population

_TOKEN = ".pbt-run-token"


def num_workers(job: JobConfig) -> int:
    """``run.num_workers`` if set, else one per CPU core; never more than members."""
    n = job.strategy.population_size  # type: ignore[union-attr]
    want = job.run.num_workers or (os.cpu_count() or 1)
    return max(1, min(want, n))


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run the population on :func:`num_workers` processes; return the summary."""
    from ...comm.launch import launch
    from ...comm.rendezvous import in_torchrun
    from ..entry import worker_entry

    validate_job(job)
    nprocs = num_workers(job)
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare_launch()
        if nprocs == 1 and not in_torchrun():
            ctx = WorkerContext(rank=0, world_size=1, workers=default_workers(1, list(job.workers)))
            ctx.device = resolve_device(job.run.device)
            out = worker_main(ctx, job, resume)
        else:
            out = launch(job, nprocs=nprocs, resume=resume, check_world_size=False,
                         entry=worker_entry, target=worker_main)
    return out or {}  # {}: under torchrun on a rank other than 0


def _check_shared(run_dir: Path, token: str, rank: int) -> None:
    """Members move between ranks through files: every rank must see rank 0's run folder."""
    try:
        seen = (run_dir / _TOKEN).read_text(encoding="utf-8")
    except OSError:
        seen = ""
    if seen != token:
        raise ConfigError([("run.output_dir", (
            f"rank {rank} cannot see rank 0's run folder {run_dir}; PopulationBased copies "
            "members through checkpoint files, so output_dir must be on a filesystem shared "
            "by all workers"))])


def _prune_members(run_dir: Path, *, keep_from: int) -> None:
    """Delete the member files of generations before ``keep_from`` (a resume writes them
    again from the population checkpoint)."""
    for d in (run_dir / "checkpoints").glob("gen-*"):
        if d.name[4:].isdigit() and int(d.name[4:]) < keep_from:
            safe_rmtree(d, run_dir)


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """One worker process: this rank's members every generation, a unit of the run's
    :class:`~paratrain.training.lifecycle.Lifecycle` (SIGINT/SIGTERM stop at the next
    generation boundary, once its checkpoint is on disk, on every rank together)."""
    started = time.perf_counter()
    size: int = job.strategy.population_size  # type: ignore[union-attr]
    main, run_dir = ctx.rank == 0, run_dir_of(job)
    runner = MemberRunner(job, run_dir, validate_job(job), ctx.device)
    if main and runner.metric in ("loss", "train_loss") and runner.mode == "max":
        warnings.warn(f"population.metric={runner.metric!r} with mode='max' selects the highest "
                      "loss; set mode='min'", stacklevel=2)
    pop: PopulationState | None = None
    token = ""
    metrics: MetricsWriter | None = None

    def population_state(done: int) -> dict[str, Any]:
        engine: dict[str, Any] = {"members": {str(i): s for i, s in runner.states.items()}}
        if pop is not None:
            engine["population"] = pop.state_dict()
        return engine_state(done, engine)

    life = Lifecycle(
        store=RankStore(run_dir, "pbt", rank=ctx.rank, world=ctx.world_size, group=ctx.group,
                        layout={"strategy": "PopulationBased"}, layout_field="run.num_workers",
                        reshard="engines"),
        unit="generation", total=job.strategy.generations,  # type: ignore[union-attr]
        label="PopulationBased", state=population_state,
        group=ctx.group if ctx.world_size > 1 else None, rank=ctx.rank, restart_count=ctx.restart_count,
        record_offset=-1, progress_every=job.run.progress_every, show=None if main else False)
    found = life.load() if resume else None
    engines: list[dict[str, Any]] = []  # one per process that saved it (same layout: this one's)
    if found is not None:
        engines = found[1]["engines"] if found[1].get("resharded") else [found[1]["engine"]]
    # the members this rank trains now, from whichever process saved them
    restored = None if found is None else {int(i): s for e in engines for i, s in
                                            (e.get("members") or {}).items()
                                            if int(i) % ctx.world_size == ctx.rank}
    if main:
        if found is not None:
            pop = PopulationState.from_state_dict(engines[0]["population"])
            if pop.size != size:
                raise ConfigError([("strategy.population_size", (
                    f"{run_dir} holds a population of {pop.size}, not {size}; resume with the "
                    "same job or start a fresh run"))])
            if pop.history and restored:
                runner.check_resume(restored, pop.history[-1]["hparams"], found[0])
        prepare_run_dir(job, resume=resume)  # job.json: only once the resume was checked
        metrics = MetricsWriter(run_dir)
        if pop is None:
            pop = PopulationState.initial(job.search_space, size=size, seed=job.run.seed)
        token = uuid.uuid4().hex
        write_text(run_dir / _TOKEN, token)
    done = int(found[1]["step"]) if found is not None else 0
    life.begin(done, resume=resume, found=found is not None, metrics=metrics)
    with life:
        return _work(ctx, job, life, runner, pop, token, metrics, started=started, done=done,
                     restored=restored)


def _work(ctx: WorkerContext, job: JobConfig, life: Lifecycle, runner: MemberRunner,
          pop: PopulationState | None, token: str, metrics: MetricsWriter | None, *,
          started: float, done: int, restored: dict[int, dict[str, Any]] | None) -> dict[str, Any] | None:
    size: int = job.strategy.population_size  # type: ignore[union-attr]
    generations: int = job.strategy.generations  # type: ignore[union-attr]
    keep = job.population.keep_generations
    main = ctx.rank == 0
    run_dir = run_dir_of(job)
    timing = {"evolve_s": 0.0, "persist_s": 0.0, "comm_s": 0.0}
    mine = [i for i in range(size) if i % ctx.world_size == ctx.rank]
    runner.preload()
    per_rank: list[dict[str, float]] = []
    loop_started = time.perf_counter()
    life.show(done)
    plan = _plan(ctx, pop, token, generations, timing)  # rank 0 sends it once its checks passed
    _check_shared(run_dir, plan["token"], ctx.rank)
    if restored is not None:  # every rank's files of the checkpoint, before any member reads one
        runner.restore(restored, done - 1)
        barrier(ctx.group)
    while not plan["done"]:
        g = int(plan["generation"])
        gathered = _train_mine(ctx, runner, plan, mine, timing)
        if gathered is not None:
            assert pop is not None and metrics is not None
            per_rank.append(_record(job, life, runner, pop, gathered, plan["lost"], metrics, timing,
                                    started=started))
        t = time.perf_counter()
        done = g + 1
        life.end_unit(done, last=done == generations)
        if main and keep is not None:
            _prune_members(run_dir, keep_from=done - keep)
        timing["persist_s"] += time.perf_counter() - t
        plan = _plan(ctx, pop, token, generations, timing)

    t = time.perf_counter()
    runner.writer.flush()
    timing["persist_s"] += time.perf_counter() - t
    timing["loop_s"] = time.perf_counter() - loop_started
    life.finish(done)
    if not main:
        return None
    assert pop is not None
    return _finish(ctx, job, runner, pop, started, timing, per_rank)


def _plan(ctx: WorkerContext, pop: PopulationState | None, token: str, generations: int,
          timing: dict[str, float]) -> dict[str, Any]:
    """Rank 0's plan of the next generation, on every rank (``done``: none is left; ``lost``:
    the members with no state, str(member) -> "generation <g>: <error>" that left them so)."""
    plan = None
    if pop is not None:
        lost = dict(pop.history[-1].get("lost", {})) if pop.history else {}
        plan = {"generation": pop.generation, "hparams": pop.hparams, "sources": pop.sources,
                "done": pop.generation >= generations, "token": token, "lost": lost}
    t = time.perf_counter()
    plan = broadcast_json(plan, group=ctx.group)
    timing["comm_s"] += time.perf_counter() - t
    return dict(plan)


def _record(job: JobConfig, life: Lifecycle, runner: MemberRunner, pop: PopulationState,
            gathered: list[dict[str, Any]], lost: dict[str, Any], metrics: MetricsWriter,
            timing: dict[str, float], *, started: float) -> dict[str, float]:
    """Rank 0 after a generation: the population advanced, the progress shown, the members
    logged and ``lineage.json`` written; returns the generation's times."""
    strategy: Any = job.strategy
    g, evolve = pop.generation, job.population.evolve
    by_member = {r["member"]: r for part in gathered for r in part["results"]}
    ordered = [by_member[i] for i in range(pop.size)]
    t = time.perf_counter()
    record = pop.advance(
        [r["fitness"] for r in ordered], mode=runner.mode, space=job.search_space,
        exploit_strategy=strategy.exploit, explore_strategy=strategy.explore,
        evolve_now=evolve and g < strategy.generations - 1,
        frozen=sorted(k for k in job.search_space if runner.roles.get(k) == "model"),
        errors=[r["error"] for r in ordered], metrics=[r["metrics"] for r in ordered])
    record["digests"] = [{"start": r["start_digest"], "end": r["end_digest"]} for r in ordered]
    record["applied"] = [r["applied"] for r in ordered]
    record["lost"] = lost_after(ordered, lost, g)
    warn_first_failures(pop, ordered, record["lost"], evolve=evolve)
    timing["evolve_s"] += time.perf_counter() - t
    loads = [float(part["flush_s"]) for part in gathered]
    for r in ordered:
        # restore (rebuild + load + apply) and save: what a persistent loop would not do
        loads[r["rank"]] += r["setup_s"] + r["load_s"] + r["save_s"]
    best_i = pop.best(runner.mode)
    best_f = record["fitness"][best_i]
    best_f = f"{best_f:.4g}" if isinstance(best_f, int | float) else best_f  # None: all failed
    life.show(pop.generation, info=f"best {runner.metric} {best_f} (member {best_i})")
    _log_members(metrics, ordered, record, g, started)
    # lineage first, the population checkpoint (collective) last, so a crash in between
    # reruns this generation on resume (metrics are truncated back to the checkpoint)
    t = time.perf_counter()
    write_json(run_dir_of(job) / "lineage.json", lineage_json(pop, metric=runner.metric, mode=runner.mode),
               indent=1)
    timing["persist_s"] += time.perf_counter() - t
    return {"checkpoint_s": max(loads), "train_s": sum(r["train_s"] for r in ordered),
            "eval_s": sum(r["eval_s"] for r in ordered)}


def _train_mine(ctx: WorkerContext, runner: MemberRunner, plan: dict[str, Any], mine: list[int],
                timing: dict[str, float]) -> list[dict[str, Any]] | None:
    """This rank's members trained for the plan's generation; every rank's results on rank 0."""
    g, lost = int(plan["generation"]), plan["lost"]
    results = [runner.run(i, g, plan["hparams"][i], plan["sources"][i],
                          lost.get(str(plan["sources"][i]))) for i in mine]
    for r in results:
        r["rank"] = ctx.rank
    t = time.perf_counter()
    runner.writer.flush()  # this rank's member files are on disk before it reports
    flush_s = time.perf_counter() - t
    if ctx.rank != 0:  # PARATRAIN_FAULT_KILL=RANK:G: dies having trained generation G-1
        maybe_kill(rank=ctx.rank, step=g + 1, restart_count=ctx.restart_count)
    t = time.perf_counter()
    gathered = gather_json({"results": results, "flush_s": flush_s}, group=ctx.group)
    timing["comm_s"] += time.perf_counter() - t
    return gathered


def _finish(ctx: WorkerContext, job: JobConfig, runner: MemberRunner, pop: PopulationState,
            started: float, timing: dict[str, float], per_rank: list[dict[str, float]]) -> dict[str, Any]:
    """Rank 0: the lineage, the summary, the best member's model and the report."""
    from ...training.export import save_model

    run_dir, metric, mode = run_dir_of(job), runner.metric, runner.mode
    write_json(run_dir / "lineage.json", lineage_json(pop, metric=metric, mode=mode), indent=1)
    summary = population_summary(job, pop, run_dir, ctx.world_size, started, timing, per_rank,
                                 metric=metric, mode=mode, task=runner.task,
                                 reference=runner.reference_metrics())
    summary["restarts"] = ctx.restart_count
    # model.safetensors: the best member's model at the end of the last generation
    best = checkpoint.load_checkpoint(member_path(run_dir, len(pop.history) - 1, int(summary["best_member"])))
    save_model(run_dir, best["model"])
    summary["parameters_sha256"] = parameters_digest(best["model"])
    write_summary(run_dir, summary)
    plot_population(run_dir / "lineage.json", run_dir / "report.png", space=job.search_space,
                    title=f"{job.run.name} (PopulationBased)")
    return summary


def _log_members(metrics: MetricsWriter, ordered: list[dict[str, Any]], record: dict[str, Any],
                 g: int, started: float) -> None:
    copied = {c["recipient"]: c["donor"] for c in record["copies"]}
    for r in ordered:
        m = r["metrics"] or {}
        metrics.log({
            "generation": g, "member": r["member"], "rank": r["rank"], "fitness": r["fitness"],
            **{f"test_{k}": v for k, v in m.items() if k not in NOT_TEST},
            "train_loss": m.get("train_loss"), "hparams": record["hparams"][r["member"]],
            "source": r["source"], "error": r["error"],
            "copied_from": copied.get(r["member"]),
            "time_s": round(time.perf_counter() - started, 4),
            "member_timing_s": {k.removesuffix("_s"): round(r[k], 5) for k in
                                ("data_s", "setup_s", "load_s", "train_s", "eval_s", "save_s")},
        })


def lost_after(ordered: list[dict[str, Any]], lost: dict[str, str], g: int) -> dict[str, str]:
    """The plan's ``lost`` after generation ``g``: a member that ends it without state keeps its
    source's first failure, or its own error when its source had state (or none)."""
    out: dict[str, str] = {}
    for r in ordered:
        if not r.get("has_state", True):
            out[str(r["member"])] = lost.get(str(r["source"])) or f"generation {g}: {r['error']}"
    return out


def warn_first_failures(pop: PopulationState, ordered: list[dict[str, Any]],
                         lost: dict[str, str], *, evolve: bool) -> None:
    """Rank 0 warns once per member, at its first failure, with the member's message."""
    failed_before = first_failures(pop.history[:-1])
    for r in ordered:
        i = r["member"]
        if r["error"] and str(i) not in failed_before:
            stays = (" It has no state to continue from; with population.evolve = false it is "
                     "never replaced and fails every later generation."
                     if str(i) in lost and not evolve else "")
            warnings.warn(f"PopulationBased member {i} failed in generation {r['generation']}: "
                          f"{r['error']}.{stays}", RuntimeWarning, stacklevel=2)


def first_failures(history: list[dict[str, Any]]) -> dict[str, str]:
    """Each member that ever failed -> its first failure ("generation <g>: <error>")."""
    out: dict[str, str] = {}
    for rec in history:
        for i, e in enumerate(rec["errors"]):
            if e and str(i) not in out:
                out[str(i)] = f"generation {rec['generation']}: {e}"
    return out


NOT_TEST = frozenset({"train_loss", "steps", "batch_size"})  # member metrics not of the test set


def population_summary(job: JobConfig, pop: PopulationState, run_dir: Path, world: int,
                       started: float, timing: dict[str, float], per_rank: list[dict[str, float]], *,
                       metric: str, mode: str, task: Any, reference: dict[str, float]) -> dict[str, Any]:
    last = pop.history[-1]
    best = pop.best(mode)
    m = last["metrics"][best] or {}
    wall = time.perf_counter() - started
    ckpt = sum(p["checkpoint_s"] for p in per_rank)
    overhead = ckpt + timing["evolve_s"] + timing["persist_s"]
    return {
        "strategy": "PopulationBased",
        "run_dir": str(run_dir),
        "population_size": pop.size,
        "generations": len(pop.history),
        "num_workers": world,
        "task": task_name(task),
        "metric": metric,
        "mode": mode,
        "evolve": job.population.evolve,
        "best_member": best,
        "best_fitness": last["fitness"][best],
        "best_hparams": last["hparams"][best],
        "best_hparams_text": " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in sorted(last["hparams"][best].items())),
        "best_schedule": ancestry(pop.history, best),
        "final_fitness": last["fitness"],
        "test_loss": m.get("loss"),
        **{f"test_{k}": v for k, v in m.items() if k not in NOT_TEST},
        **reference,
        "parameters_sha256": None,  # the best member's saved model's (the runner's)
        "copies": sum(len(r["copies"]) for r in pop.history),
        "member_steps": sum(int(m["steps"]) for r in pop.history for m in r["metrics"] if m),
        "failures": sum(1 for r in pop.history for e in r["errors"] if e),
        "first_failures": first_failures(pop.history),
        "wall_time_s": round(wall, 3),
        # This process's share only (a resumed run times the generations it ran).
        "timing": {
            "train_s": round(sum(p["train_s"] for p in per_rank), 4),
            "eval_s": round(sum(p["eval_s"] for p in per_rank), 4),
            "checkpoint_s": round(ckpt, 4),
            "evolve_s": round(timing["evolve_s"], 4),
            "persist_s": round(timing["persist_s"], 4),
            "comm_s": round(timing["comm_s"], 4),
            # generation loop only (no process start, imports or data loading)
            "loop_s": round(timing["loop_s"], 4),
            "overhead_s": round(overhead, 4),
            "overhead_fraction": round(overhead / timing["loop_s"], 5) if timing["loop_s"] > 0 else None,
        },
    }
