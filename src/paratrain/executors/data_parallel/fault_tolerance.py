"""DataParallel under ``[fault_tolerance]``: one replica group (one process) per replica on
torchft (:mod:`paratrain.comm.ft`), restarted alone when it dies (docs/data-parallel.md).

Replica ``g`` of ``n`` walks shard ``g`` of every epoch (as plain DataParallel). Step ``k``
averages the gradients of the groups in step ``k``'s quorum ``Q_k``:
``g_k = (1/|Q_k|) sum_{r in Q_k} g_r``; with every group alive this is plain DataParallel's
AllReduce. What a failure costs: the shards of the groups missing from ``Q_k`` for step ``k``
are not trained (torchft's semantics), unless ``replay``: then the groups of ``Q_k`` also
train the missing groups' batches of step ``k`` and ``g_k = (1/n) sum_{r < n} g_r``, the
failure-free step (up to the order of the sums). A step that fails midway (a peer died inside
its all-reduce) is not committed and the survivors take it again on the same batches, so they
lose nothing. A restarted group rejoins at the next quorum and heals from a live peer's state
(model, optimizer, schedule, RNG, loop position: the loop's checkpoint state, sent by
torchft's checkpoint transport), not from disk; it then walks its own shard from that
position. Replica group 0 writes the checkpoints and metrics; the model and summary are
written by group 0, or by the first group after those lost for good; every group writes
``replica-<g>.json`` (its digest and restarts) when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from ...comm import ft
from ...comm.forkserver import ParentState
from ...comm.launch import WorkerError, append_worker_log
from ...comm.process import resolve_device
from ...comm.rendezvous import in_torchrun
from ...config import ConfigError
from ...config.job import JobConfig
from ...data.loader import LoaderOptions, dataset_rows, is_stream
from ...training import (
    MetricsWriter,
    build_optimizer,
    prepare_run_dir,
    report,
    seed_everything,
    write_summary,
)
from ...training.loop import (
    DataPlan,
    LocalEngine,
    LoopRun,
    Trainer,
    feed_of,
    run_loop,
    summary_fields,
)
from ...training.rundir import RunFolder, run_dir_of
from ...training.stores import RankStore
from ...training.threads import intra_op_threads
from .runner import _load_task, shard_indices, validate

MAX_TRIES = 10  # a step not committed this many times in a row fails the group
FATAL_EXIT = 3  # a group's exit code for a failure no restart mends (ConfigError, no quorum)


class FaultTolerantEngine(LocalEngine):
    """A replica group's step: its gradients averaged over the step's quorum (one flat
    all-reduce with one used-flag per parameter: a parameter no group used keeps
    ``grad = None``, as DataParallel's AllReduce)."""

    def __init__(self, model: Any, task: Any, test: Any, *, device: torch.device, precision: str,
                 group: ft.ReplicaGroup, evaluates: Any) -> None:
        super().__init__(model, task, test, device=device, precision=precision)
        self.group, self.evaluates = group, evaluates
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.divisor: int | None = None  # replay: a sum over the quorum divided by this
        self.groups = 0  # the last committed step's quorum (a change is logged)

    def sync(self) -> None:
        ps = self.params
        used = torch.tensor([float(p.grad is not None) for p in ps], device=self.device)
        flat = torch.cat([*(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=self.device)
                            for p in ps), used])
        if self.divisor is None:
            self.group.mean_(flat)
        else:
            self.group.sum_(flat)[:-len(ps)] /= self.divisor
        offset = 0
        for p, flag in zip(ps, flat[-len(ps):].tolist(), strict=True):
            k = p.numel()
            p.grad = flat[offset:offset + k].view_as(p).clone() if flag > 0 else None
            offset += k

    def after_step(self) -> dict[str, float]:
        """``{"groups": q}`` (metrics) at the first step and when the quorum's size changed."""
        q, last = self.group.participants, self.groups
        self.groups = q
        return {"groups": float(q)} if q != last else {}

    def evaluate(self) -> dict[str, float] | None:
        return super().evaluate() if self.evaluates() else None


class FaultTolerantTrainer(Trainer):
    """A step is committed by every group of its quorum, or taken again (same batches, new
    quorum); the optimizer and the schedule step only when it is. ``replay(m)``: replica
    ``m``'s batches of this step; with it the groups of a quorum of ``q`` train the missing
    groups' batches too (the ``k``-th missing one falls to the ``(k mod q)``-th group alive)
    and the step's gradient is ``(1/n) sum_{r < n} g_r``, every shard's."""

    def __init__(self, engine: FaultTolerantEngine, optimizer: Any, train: Any, total_steps: int,
                 groups: int, replica: int, replay: Any = None) -> None:
        super().__init__(engine, optimizer, train, total_steps)
        self.group, self.groups, self.replica, self.replay = engine.group, groups, replica, replay
        engine.divisor = groups if replay is not None else None
        self.short = 0  # committed steps with fewer groups than the job's (this process's)

    def step(self, batches: Any) -> float:
        for _ in range(MAX_TRIES):
            self.group.begin()
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.accumulate(batches)
            for m in self._taken_over() if self.replay is not None else ():
                self.accumulate(self.replay(m))
            self.engine.sync()
            if self.group.commit():
                self.short += self.group.participants < self.groups
                self.apply()
                return loss
        raise RuntimeError(f"a step was not committed in {MAX_TRIES} tries")

    def _taken_over(self) -> list[int]:
        """The missing groups whose batches this group trains (one sum says who is here)."""
        here = torch.zeros(self.groups)
        here[self.replica] = 1.0
        self.group.sum_(here)  # an error leaves this group alone here: the step is not committed
        live = [r for r in range(self.groups) if here[r] > 0.5]
        gone = [r for r in range(self.groups) if r not in live]
        j = live.index(self.replica) if self.replica in live else 0
        return [m for k, m in enumerate(gone) if k % len(live) == j]


class HealingStore:
    """The loop's store for a replica group: loading joins the first quorum (after the disk
    checkpoint, on resume or restart) and returns a live peer's state when this group was
    behind; ``disk`` (group 0 only) writes checkpoints."""

    def __init__(self, disk: RankStore, *, writes: bool, resume: bool, ended: Any = None) -> None:
        self.disk, self.writes, self.resume, self.ended = disk, writes, resume, ended
        self.start: Any = None  # the start line (ReplicaGroup.start), before the first quorum
        self.group: ft.ReplicaGroup | None = None
        self._state: Any = None  # the loop's live state (bound once it runs)
        self.position: Any = None  # the loop's position (bound with it)
        self.received: dict[str, Any] | None = None
        self.healed_at: float | None = None

    def bind_state(self, state: Any, position: Any) -> None:
        self._state, self.position = state, position

    def live(self) -> dict[str, Any]:
        """What a healing peer receives."""
        if self._state is None:
            raise RuntimeError("this replica group's loop has not started")
        return dict(self._state())

    def take(self, state: dict[str, Any]) -> None:
        """A peer's state (torchft heals this group): only when joining."""
        if self._state is not None:
            raise ft.FellBehind("this replica group's step was not committed while its peers' was")
        self.received = state

    def load(self, held: Any = None) -> tuple[Path, dict[str, Any]] | None:
        assert self.group is not None
        found = self.disk.load(held) if self.resume else None
        if found is not None:
            self.group.set_step(int(found[1]["step"]))
        if self.start is not None:
            self.start()  # the first attempts meet: the first quorum has every group
        self.group.begin()
        if self.received is not None:
            state, self.received = {**self.received, "loader": {}}, None
            self.healed_at = time.time()  # wall clock: the supervisor's restart times are too
            print(f"replica group {self.group.replica} healed from a live peer at step {state['step']}",
                  file=sys.stderr, flush=True)
            return Path("a live peer"), state
        if self.ended is not None and self.ended():
            raise RunEnded  # restarted, no peer to heal from: the others finished the run
        return found

    def start_save(self, step: int, state: dict[str, Any]) -> None:
        if self.writes:
            self.disk.start_save(step, state)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.start_save(step, state)
        self.wait()

    def wait(self) -> None:
        self.disk.wait()


class RunEnded(Exception):
    """A restarted group found the run finished by its peers: nothing left to train."""


def _ended(run_dir: Path) -> bool:
    return any(run_dir.glob("replica-*.json"))


def _lost(run_dir: Path, replica: int) -> Path:
    return run_dir / f".replica-{replica}-lost"


def _reports(run_dir: Path, replica: int) -> bool:
    """This group evaluates and writes the model and the summary: every group before it is
    lost for good (group 0 unless it is)."""
    return all(_lost(run_dir, g).exists() for g in range(replica))


def train_group(job: JobConfig, *, replica: int, lighthouse: str, start_line: str | None, resume: bool,
                restart_count: int) -> None:
    """Train replica group ``replica`` through the one loop (module docstring); ``start_line``
    None: it joins a running job (as a restarted group does: no waiting for the others)."""
    started, s, fto = time.perf_counter(), validate(job), job.fault_tolerance
    assert fto is not None
    n, seed, t, run_dir = s.num_replicas, job.run.seed, job.train, run_dir_of(job)
    seed_everything(seed)
    task, train, test = _load_task(job)
    if is_stream(train):
        raise ConfigError([("fault_tolerance", "a stream (an IterableDataset) has no position a "
                                               "healing replica group could take from a peer")])
    rows, device = dataset_rows(train), resolve_device(job.run.device)
    model = task.build_model(job.model, train).to(device)
    opt = build_optimizer(model.parameters(), t.optimizer)
    disk = RankStore(run_dir, "dp", rank=0, world=1, group=None, layout={"replicas": n, "shard": "none"},
                     layout_field="strategy.num_replicas", device=device, reshard=True)
    store = HealingStore(disk, writes=replica == 0, resume=resume,
                         ended=(lambda: _ended(run_dir)) if restart_count or start_line is None else None)
    group = store.group = ft.ReplicaGroup(
        replica=replica, lighthouse=lighthouse, min_replicas=fto.min_replicas,
        quorum_timeout_s=fto.quorum_timeout_s, timeout_s=job.comm.timeout_s, state=store.live, load=store.take)
    if start_line is not None:
        store.start = lambda: group.start(start_line, replica=replica, groups=fto.groups or n,
                                          wait=not restart_count)
    try:
        plan = DataPlan.build(
            dataset=train, order=lambda e: shard_indices(rows, world=n, rank=replica, seed=seed, epoch=e),
            examples_per_epoch=rows // n, batch_size=t.batch_size, accumulation=t.grad_accumulation,
            epochs=t.epochs, max_steps=t.max_steps, device=device, loader=LoaderOptions.of(job.data, seed),
            shard=(replica, n))
        engine = FaultTolerantEngine(model, task, test, device=device, precision=t.precision, group=group,
                                     evaluates=lambda: _reports(run_dir, replica))
        result = run_loop(LoopRun(
            trainer=(trainer := FaultTolerantTrainer(engine, opt, t, plan.total_steps, n, replica, replay=(
                _replayer(plan, task, store, rows=rows, groups=n, seed=seed) if fto.replay else None))),
            plan=plan, task=task, store=store,
            label=f"DataParallel x{n} (fault-tolerant)", metrics=MetricsWriter(run_dir) if replica == 0 else None,
            resume=True, prepare=_prepare(job, replica, resume), rank=replica,
            restart_count=restart_count, started=started,
            layout={"strategy": "DataParallel", "replicas": n, "shard": "none"}, **LoopRun.settings(job)))
    finally:
        group.close()
    summary = {"strategy": "DataParallel", "aggregation": "AllReduce", "num_replicas": n, "backend": "gloo",
               "run_dir": str(run_dir), **summary_fields(result, task, train=train, test=test, model=model,
                                                         started=started), "restart_count": restart_count}
    if _reports(run_dir, replica):
        from ...training.export import save_model, whole_state

        save_model(run_dir, whole_state(model))
        write_summary(run_dir, summary)
        report.plot_curves(run_dir, title=f"{job.run.name} (DataParallel x{n}, fault-tolerant)")
    (run_dir / f"replica-{replica}.json").write_text(json.dumps(
        {"replica": replica, "parameters_sha256": summary["parameters_sha256"], "steps": summary["steps"],
         "restart_count": restart_count, "resumed_from": summary.get("resumed_from"),
         "steps_short_of_groups": trainer.short, "healed_at": store.healed_at}))


def _replayer(plan: DataPlan, task: Any, store: HealingStore, *, rows: int, groups: int, seed: int) -> Any:
    """``replay(m)``: replica ``m``'s batches of the step at the loop's position, from its
    shard as its own loop reads it (same order, same per-replica seeding), in this process."""
    feeds: dict[int, Any] = {}

    def replay(m: int) -> list[Any]:
        if m not in feeds:
            order = functools.partial(shard_indices, rows, world=groups, rank=m, seed=seed)
            feeds[m] = feed_of(dataclasses.replace(plan, order=lambda e: order(epoch=e), shard=(m, groups),
                                                   loader=dataclasses.replace(plan.loader, num_workers=0)), task)
        pos = store.position
        stop = min(pos.batch + plan.accumulation, plan.batches_per_epoch)
        return list(itertools.islice(feeds[m].batches(pos.epoch, pos.batch), stop - pos.batch))
    return replay


def _prepare(job: JobConfig, replica: int, resume: bool) -> Any:
    """After the first quorum: group 0 makes the run folder (job.json)."""
    def prepare() -> None:
        if replica == 0:
            prepare_run_dir(job, resume=resume)
    return prepare


def _error_file(run_dir: Path, replica: int) -> Path:
    return run_dir / f".replica-{replica}-error.json"


def group_main(job_json: dict[str, Any], resume: bool, replica: int, lighthouse: str, start_line: str | None,
               restart_count: int, parent: ParentState) -> None:
    """Entry of a replica group's process (module-level: the forkserver pickles it by name).
    Exit 0 when done, :data:`FATAL_EXIT` for what no restart mends (its error in a file the
    supervisor reads), 1 for anything else (restarted)."""
    from ...comm.process import exit_process

    parent.apply()
    if not os.environ.get("PARATRAIN_DEBUG"):
        # torchft's per-quorum warnings (no NCCL here), and its traceback of a peer lost inside
        # an all-reduce, which is handled (the step is not committed; a lost quorum is raised)
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        # a healing group reads the peer's tensors from a read-only HTTP body, once
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
    job = JobConfig.model_validate(job_json)
    if job.run.imports:
        from ..plugins import import_plugins

        import_plugins(list(job.run.imports))
    torch.set_num_threads(intra_op_threads(job, local=int(getattr(job.strategy, "num_replicas", 1))))
    code, run_dir = 0, run_dir_of(job)
    try:
        train_group(job, replica=replica, lighthouse=lighthouse, start_line=start_line, resume=resume,
                    restart_count=restart_count)
    except RunEnded:
        pass
    except Exception as e:  # noqa: BLE001 - the supervisor reads the exit code and this record
        append_worker_log(job, replica, f"replica group {replica}, attempt {restart_count}: {traceback.format_exc()}")
        fatal = isinstance(e, ConfigError | ft.QuorumTimeout)
        code = FATAL_EXIT if fatal else 1
        if fatal:
            problems = e.problems if isinstance(e, ConfigError) else [["", str(e)]]
            _error_file(run_dir, replica).write_text(json.dumps(
                {"config": isinstance(e, ConfigError), "problems": problems}))
    exit_process(code)


def _fatal(run_dir: Path) -> Any:
    """The supervisor's reading of a group's failure: its ConfigError or WorkerError."""
    def fatal(replica: int, code: int) -> BaseException | None:
        path = _error_file(run_dir, replica)
        if code != FATAL_EXIT or not path.exists():
            return None
        doc = json.loads(path.read_text())
        problems = [(str(f), str(m)) for f, m in doc["problems"]]
        if doc["config"]:
            return ConfigError(problems)
        return WorkerError(replica, problems[0][1], log=run_dir / f"worker-{replica}.log")
    return fatal


def _restarted(times: dict[str, list[float]]) -> Any:
    """One line per restart; ``times``: each group's restart times (wall clock)."""
    def restarted(replica: int, why: str) -> None:
        times.setdefault(str(replica), []).append(time.time())
        print(f"replica group {replica} died ({why}); restarted alone, it heals from a live peer",
              file=sys.stderr, flush=True)
    return restarted


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Start the Lighthouse (``lighthouse = "start"``) and one process per replica group,
    restart a group that dies (``run.max_restarts`` times each), return the summary
    with each group's restarts and digest once every process ended."""
    s, fto = validate(job), job.fault_tolerance
    assert fto is not None
    if in_torchrun():
        raise ConfigError([("fault_tolerance", "paratrain run starts the replica groups itself "
                                               "(one process each); run the job without torchrun")])
    task, train, _ = _load_task(job)
    validate(job, num_train=None if is_stream(train) else len(train))
    task.build_model(job.model, train)
    n, job_json = s.num_replicas, job.to_json_dict()
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare_launch()
        run_dir = folder.path
        for old in [*run_dir.glob("replica-*.json"), *run_dir.glob(".replica-*")]:
            old.unlink()
        restarted_at: dict[str, list[float]] = {}
        with _lighthouse(fto) as address, ft.start_line() as line:
            _lighthouse_file(run_dir).write_text(address)  # where a group joining later reaches it
            started = ft.supervise(
                group_main, lambda g, r: (job_json, resume or r > 0, g, address, line, r, ParentState()),
                groups=range(fto.groups or n), max_restarts=job.run.max_restarts, fatal=_fatal(run_dir),
                preload=[__name__], on_restart=_restarted(restarted_at), on_lost=lambda g: _lost(run_dir, g).touch())
    restarts = [started.get(g, 0) for g in range(n)]
    if not (run_dir / "summary.json").exists():  # group 0 died after the others had ended
        raise RuntimeError(f"no replica group wrote the summary: group 0 failed after the others had "
                           f"ended (restarts {restarts}); the last checkpoint is in {run_dir / 'checkpoints'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ends = [run_dir / f"replica-{g}.json" for g in range(n)]
    summary["fault_tolerance"] = {
        "restarts": restarts, "min_replicas": fto.min_replicas, "restarted_at": restarted_at,
        "parameters_sha256_by_replica": [json.loads(p.read_text())["parameters_sha256"] if p.exists() else None
                                         for p in ends]}
    write_summary(run_dir, summary)
    return dict(summary)


def _lighthouse_file(run_dir: Path) -> Path:
    return run_dir / ".replica-lighthouse"


def join_group(job: JobConfig, replica: int) -> dict[str, Any] | None:
    """Run replica group ``replica`` of the running fault-tolerant ``job`` (one its ``paratrain
    run`` did not start, ``fault_tolerance.groups``, or one that left) in a process of its own
    until the job ends: it heals from a live peer at its first quorum and walks its own shard
    from there. Returns its ``replica-<g>.json`` record (None: the job had ended)."""
    fto, run_dir = job.fault_tolerance, run_dir_of(job)
    if fto is None:
        raise ConfigError([("fault_tolerance", "the job has no [fault_tolerance] table: no replica group to join")])
    s = validate(job)
    if not 0 <= replica < s.num_replicas:
        raise ConfigError([("strategy.num_replicas", f"replica group {replica} is not one of the job's "
                                                     f"{s.num_replicas} groups (0 to {s.num_replicas - 1})")])
    if fto.lighthouse != "start":  # the Lighthouse the job names (groups on several hosts)
        address = _named(fto)
        run_dir.mkdir(parents=True, exist_ok=True)  # this host's own folder
    elif _lighthouse_file(run_dir).exists():
        address = _lighthouse_file(run_dir).read_text()
    else:
        raise ConfigError([("run.name", f"no fault-tolerant run is going on in {run_dir} "
                                        "(no Lighthouse address there)")])
    job_json = job.to_json_dict()
    ft.supervise(group_main, lambda g, r: (job_json, True, g, address, None, r, ParentState()), groups=[replica],
                 max_restarts=job.run.max_restarts, fatal=_fatal(run_dir), preload=[__name__])
    record = run_dir / f"replica-{replica}.json"
    return dict(json.loads(record.read_text())) if record.exists() else None


def _lighthouse(fto: Any) -> Any:
    """The Lighthouse paratrain starts, or the address of the one the job names."""
    if fto.lighthouse == "start":
        return ft.lighthouse(min_replicas=fto.min_replicas, join_timeout_s=fto.join_timeout_s,
                             heartbeat_timeout_s=fto.heartbeat_timeout_s, listen=fto.listen)
    return contextlib.nullcontext(_named(fto))


def _named(fto: Any) -> str:
    return fto.lighthouse if "://" in fto.lighthouse else f"http://{fto.lighthouse}"
