"""DataParallel under ``[fault_tolerance]``: replica groups on torchft (:mod:`paratrain.comm.ft`),
each restarted alone, whole, when one of its processes dies (docs/data-parallel.md).

The ``n = strategy.num_replicas`` processes form ``G = n / k`` groups of ``k =
fault_tolerance.processes_per_group``; process ``i`` of group ``g`` walks shard ``g k + i`` of
every epoch (plain DataParallel's rank). Step ``t`` averages the gradients of the groups in
step ``t``'s quorum ``Q_t``: ``g_t = (1/|Q_t|) sum_{h in Q_t} g_h``, ``g_h`` the mean over group
``h``'s processes; with every group alive this is plain DataParallel's AllReduce (its mean over
all ``n``). A group of one process holds the whole model (:class:`FaultTolerantEngine`); a group
of ``k > 1`` shards by ZeRO among its processes, and process ``i`` averages its rows with
process ``i`` of the other groups (:class:`FaultTolerantZeroEngine`, torchft's HSDP).

What a failure costs: the shards of the groups missing from ``Q_t`` for step ``t`` are not
trained (torchft's semantics), unless ``replay`` (groups of one process): then the groups of
``Q_t`` also train the missing groups' batches of step ``t`` and ``g_t = (1/n) sum_{r < n}
g_r``, the failure-free step (up to the order of the sums). A step that fails midway (a peer died inside
its all-reduce) is not committed and the survivors take it again on the same batches, so they
lose nothing. A restarted group rejoins at the next quorum and heals from a live peer's state
(model, optimizer, schedule, RNG, loop position: the loop's checkpoint state, sent by
torchft's checkpoint transport), not from disk; it then walks its own shard from that
position (each process from the same process of the live group: its own rows). Replica
group 0 writes the checkpoints during the run (each of its processes its rows) and metrics;
the final checkpoint, the model and the summary are written by the lowest-numbered group of
the quorum that committed the last step (:class:`Reporter`), so by exactly one group that
took the last step; a restarted group that finds the run ended (its peers took the last step:
no peer to heal from) exits cleanly. Every group that finished writes ``replica-<g>.json``
(its digest and restarts) when it ends.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...comm import buckets as B
from ...comm import collectives as C
from ...comm import ft
from ...comm.context import WorkerContext
from ...comm.forkserver import ParentState
from ...comm.launch import WorkerError, append_worker_log
from ...comm.process import join_process_group, resolve_device
from ...comm.rendezvous import in_torchrun
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel
from ...data.loader import LoaderOptions, dataset_rows, is_stream
from ...task.steps import evaluate as evaluate_task
from ...training import (
    MetricsWriter,
    build_optimizer,
    prepare_run_dir,
    report,
    seed_everything,
    write_summary,
)
from ...training.faults import maybe_hold_restart
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
from ...training.stepping import autocast
from ...training.stores import RankStore
from ...training.threads import intra_op_threads
from ..shared.zero import ZeroEngine
from .runner import _load_task, _shared_buffers, shard_indices, shard_layout, validate

MAX_TRIES = 10  # a step not committed this many times in a row fails the group
FATAL_EXIT = 3  # a group's exit code for a failure no restart mends (ConfigError, no quorum)


def mean_over_quorum(quorum: ft.ReplicaGroup, params: Sequence[torch.Tensor], *, device: torch.device,
                     divisor: int | None = None) -> None:
    """Each ``p.grad`` <- ``(1/|Q|) sum_{h in Q} p.grad_h`` over the step's quorum ``Q`` (one
    flat all-reduce through the Manager, a used-flag per tensor appended: a tensor no group
    used keeps ``grad = None``, as DataParallel's AllReduce); ``divisor`` (replay): the sum
    over ``Q`` divided by it instead. ``params`` must be the same list on every group (the
    whole model, or process ``i``'s ZeRO rows, the same on process ``i`` of every group)."""
    used = torch.tensor([float(p.grad is not None) for p in params], device=device)
    flat = torch.cat([*(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=device)
                        for p in params), used])
    if divisor is None:
        quorum.mean_(flat)
    else:
        quorum.sum_(flat)[:-len(params)] /= divisor
    offset = 0
    for p, flag in zip(params, flat[-len(params):].tolist(), strict=True):
        k = p.numel()
        p.grad = flat[offset:offset + k].view_as(p).clone() if flag > 0 else None
        offset += k


def _quorum_change(engine: Any) -> dict[str, float]:
    """``{"groups": q}`` (metrics) at the first step and when the quorum's size changed."""
    q, last = engine.quorum.participants, engine.groups
    engine.groups = q
    return {"groups": float(q)} if q != last else {}


class FaultTolerantEngine(LocalEngine):
    """A replica group's step (one process, the whole model): its gradients averaged over
    the step's quorum (:func:`mean_over_quorum`)."""

    def __init__(self, model: Any, task: Any, test: Any, *, device: torch.device, precision: str,
                 quorum: ft.ReplicaGroup, evaluates: Any) -> None:
        super().__init__(model, task, test, device=device, precision=precision)
        self.quorum, self.evaluates = quorum, evaluates
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.divisor: int | None = None  # replay: a sum over the quorum divided by this
        self.groups = 0  # the last committed step's quorum (a change is logged)

    def sync(self) -> None:
        mean_over_quorum(self.quorum, self.params, device=self.device, divisor=self.divisor)

    def after_step(self) -> dict[str, float]:
        return _quorum_change(self)

    def evaluate(self) -> dict[str, float] | None:
        return super().evaluate() if self.evaluates() else None


class FaultTolerantZeroEngine(ZeroEngine):
    """Process ``i`` of a replica group of ``k`` sharded by ZeRO (torchft's HSDP layout):
    :class:`~..shared.zero.ZeroEngine` over the group's own processes leaves each process
    its rows of the group's mean gradient, ``(1/k) sum_{j<k} g_{h,j}[rows i]``, which
    :func:`mean_over_quorum` averages with process ``i`` of every group of the step's quorum:
    ``(1/|Q|) sum_{h in Q} (1/k) sum_{j<k} g_{h,j}[rows i]``, rows ``i`` of the mean over the
    quorum's ``|Q| k`` processes (plain DataParallel's mean with every group alive). The
    parameters, gradients and optimizer state a process holds stay ZeRO's."""

    def __init__(self, *args: Any, quorum: ft.ReplicaGroup, evaluates: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quorum, self.evaluates = quorum, evaluates
        self.divisor: int | None = None  # replay is refused with several processes a group
        self.groups = 0

    def sync(self) -> None:
        super().sync()
        mean_over_quorum(self.quorum, list(self.model.parameters()), device=self.device)

    def after_step(self) -> dict[str, float]:
        return {**super().after_step(), **_quorum_change(self)}

    def evaluate(self) -> dict[str, float] | None:
        self.gather_all()  # collective over the group's processes (ZeRO-3), whichever group reports
        try:
            if not (self.ctx.is_main and self.evaluates()):
                return None
            with autocast(self.precision, self.device):
                return evaluate_task(self.net, self.task, self.test, device=self.device)
        finally:
            self.free_all()


class Reporter:
    """Who writes the model, the summary and the final checkpoint: the lowest-numbered group of
    the quorum that committed the run's last step (every group of it learns who is there from one
    sum in that step, :class:`FaultTolerantTrainer`), so exactly one group that took the last
    step, whichever groups were lost, restarted or are still restarting. Until then (evaluations
    during the run), and in a run that takes no step (a finished run resumed): group 0, or the
    first group after those lost for good. Checkpoints during the run are group 0's."""

    def __init__(self, run_dir: Path, replica: int) -> None:
        self.run_dir, self.replica = run_dir, replica
        self.last: list[int] | None = None  # the groups that committed the run's last step

    def __call__(self) -> bool:
        """Whether this group evaluates for, and writes, the run's records."""
        return _reports(self.run_dir, self.replica) if self.last is None else min(self.last) == self.replica

    def checkpoints(self) -> bool:
        """Whether this group writes the checkpoint now: group 0's cadence, the reporter's last step."""
        return self.replica == 0 if self.last is None else self()

    def finished(self, live: list[int]) -> None:
        """The run's last step was committed by the groups ``live`` (a restarted group's first
        quorum now finds the run ended, :func:`_ended`)."""
        self.last = live
        _ended_file(self.run_dir).touch()


class FaultTolerantTrainer(Trainer):
    """A step is committed by every group of its quorum, or taken again (same batches, new
    quorum); the optimizer and the schedule step only when it is. ``replay(m)``: replica
    ``m``'s batches of this step; with it the groups of a quorum of ``q`` train the missing
    groups' batches too (the ``k``-th missing one falls to the ``(k mod q)``-th group alive)
    and the step's gradient is ``(1/n) sum_{r < n} g_r``, every shard's. The run's last step
    (and every step with replay) sums who is here, which names the :class:`Reporter`."""

    def __init__(self, engine: FaultTolerantEngine | FaultTolerantZeroEngine, optimizer: Any, train: Any,
                 total_steps: int, groups: int, replica: int, *, reporter: Reporter, replay: Any = None) -> None:
        super().__init__(engine, optimizer, train, total_steps)
        self.group, self.groups, self.replica, self.replay = engine.quorum, groups, replica, replay
        self.total, self.reporter = total_steps, reporter
        engine.divisor = groups if replay is not None else None
        self.short = 0  # committed steps with fewer groups than the job's (this process's)

    def step(self, batches: Any) -> float:
        for _ in range(MAX_TRIES):
            self.group.begin()
            last = self.group.step + 1 >= self.total  # the same on every group of the quorum
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.accumulate(batches)
            live = self._live() if self.replay is not None or last else []
            for m in self._taken_over(live) if self.replay is not None else ():
                self.accumulate(self.replay(m))
            self.engine.sync()
            if self.group.commit():
                self.short += self.group.participants < self.groups
                if last:
                    self.reporter.finished(live)
                self.apply()
                return loss
        raise RuntimeError(f"a step was not committed in {MAX_TRIES} tries")

    def _live(self) -> list[int]:
        """The groups of this step's quorum (one sum says who is here)."""
        here = torch.zeros(self.groups)
        here[self.replica] = 1.0
        self.group.sum_(here)  # an error leaves this group alone here: the step is not committed
        return [r for r in range(self.groups) if here[r] > 0.5]

    def _taken_over(self, live: list[int]) -> list[int]:
        """The missing groups whose batches this group trains."""
        gone = [r for r in range(self.groups) if r not in live]
        j = live.index(self.replica) if self.replica in live else 0
        return [m for k, m in enumerate(gone) if k % len(live) == j]


class HealingStore:
    """The loop's store for a replica group: loading joins the first quorum (after the disk
    checkpoint, on resume or restart) and returns a live peer's state when this group was
    behind; ``disk`` writes the checkpoints when ``writes()`` (:meth:`Reporter.checkpoints`)."""

    def __init__(self, disk: RankStore, *, writes: Any, resume: bool, ended: Any = None,
                 agree: Any = bool) -> None:
        # agree(flag): true on every process of the group when true on one (several processes)
        self.disk, self.writes, self.resume, self.ended, self.agree = disk, writes, resume, ended, agree
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
        if self.ended is not None and self.agree(self.ended()):
            raise RunEnded  # restarted, no peer to heal from: the others finished the run
        return found

    def start_save(self, step: int, state: dict[str, Any]) -> None:
        if self.writes():
            self.disk.start_save(step, state)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.start_save(step, state)
        self.wait()

    def wait(self) -> None:
        self.disk.wait()


class RunEnded(Exception):
    """A restarted group found the run finished by its peers: nothing left to train."""


def _ended_file(run_dir: Path) -> Path:
    """Made by each group that committed the run's last step, as it did (:meth:`Reporter.finished`)."""
    return run_dir / ".replica-ended"


def _ended(run_dir: Path) -> bool:
    return _ended_file(run_dir).exists() or any(run_dir.glob("replica-*.json"))


def _lost(run_dir: Path, replica: int) -> Path:
    return run_dir / f".replica-{replica}-lost"


def _reports(run_dir: Path, replica: int) -> bool:
    """Every group before this one is lost for good (group 0 unless it is): the
    :class:`Reporter` until the run's last step is committed."""
    return all(_lost(run_dir, g).exists() for g in range(replica))


def train_group(job: JobConfig, *, replica: int, lighthouse: str, start_line: str | None, resume: bool,
                restart_count: int, member: ft.Member) -> None:
    """Train process ``member.rank`` of replica group ``replica`` through the one loop (module
    docstring): data shard ``replica * k + member.rank`` of ``num_replicas`` (plain
    DataParallel's rank), ``k`` the group's processes; ``start_line`` None: it joins a running
    job (as a restarted group does: no waiting for the others)."""
    started, s, fto = time.perf_counter(), validate(job), job.fault_tolerance
    assert fto is not None
    n, k, seed, t, run_dir = s.num_replicas, member.size, job.run.seed, job.train, run_dir_of(job)
    maybe_hold_restart(run_dir, restart_count=restart_count)  # tests only (PARATRAIN_FAULT_HOLD_RESTART)
    ctx = _join(job, member, restart_count)
    seed_everything(seed)
    task, train, test = _load_task(job)
    if is_stream(train):
        raise ConfigError([("fault_tolerance", "a stream (an IterableDataset) has no position a "
                                               "healing replica group could take from a peer")])
    rows, device, shard = dataset_rows(train), ctx.device, replica * k + member.rank
    model = task.build_model(job.model, train).to(device)
    reporter = Reporter(run_dir, replica)
    store = _healing_store(job, ctx, replica=replica, resume=resume, writes=reporter.checkpoints,
                           restarted=bool(restart_count) or start_line is None)
    group = store.group = ft.ReplicaGroup(
        replica=replica, lighthouse=lighthouse, min_replicas=fto.min_replicas, quorum_timeout_s=fto.quorum_timeout_s,
        timeout_s=job.comm.timeout_s, state=store.live, load=store.take, member=member, control=ctx.store)
    if start_line is not None:
        store.start = lambda: group.start(start_line, replica=replica, groups=fto.groups or n // k,
                                          wait=not restart_count)
    engine: Any = None
    try:
        engine, opt = _engine(job, ctx, model, task, test, group, evaluates=reporter)
        plan = DataPlan.build(
            dataset=train, order=lambda e: shard_indices(rows, world=n, rank=shard, seed=seed, epoch=e),
            examples_per_epoch=rows // n, batch_size=t.batch_size, accumulation=t.grad_accumulation,
            epochs=t.epochs, max_steps=t.max_steps, device=device, loader=LoaderOptions.of(job.data, seed),
            shard=(shard, n))
        result = run_loop(LoopRun(
            trainer=(trainer := FaultTolerantTrainer(engine, opt, t, plan.total_steps, n // k, replica, replay=(
                _replayer(plan, task, store, rows=rows, groups=n, seed=seed) if fto.replay else None),
                reporter=reporter)),
            plan=plan, task=task, store=store, label=f"DataParallel x{n} (fault-tolerant)",
            metrics=MetricsWriter(run_dir) if shard == 0 else None, resume=True, prepare=_prepare(job, shard, resume),
            rank=shard, restart_count=restart_count, started=started, group=ctx.group,
            layout={"strategy": "DataParallel", "replicas": n, "shard": s.shard}, **LoopRun.settings(job)))
    finally:
        group.close()
        if isinstance(engine, ZeroEngine):
            engine.close()
    _finish(job, ctx, replica, trainer, result, store, model=model, data=(task, train, test), started=started,
            restart_count=restart_count)


def _join(job: JobConfig, member: ft.Member, restart_count: int) -> WorkerContext:
    """This process's place in its replica group: alone, or process ``member.rank`` of the
    group's own default process group (ZeRO's collectives), met at the supervisor's store
    under a fresh prefix for each start of the group."""
    if member.size == 1:
        return WorkerContext(rank=0, world_size=1, device=resolve_device(job.run.device))
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(member.port), "RANK": str(member.rank),
        "WORLD_SIZE": str(member.size), "LOCAL_RANK": str(member.rank), "LOCAL_WORLD_SIZE": str(member.size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the supervisor holds the store
        "TORCHELASTIC_RESTART_COUNT": str(restart_count)})
    threads = torch.get_num_threads()  # joining sets one thread a process (as torchrun's workers)
    ctx = join_process_group(job)
    torch.set_num_threads(threads)
    return ctx


def _healing_store(job: JobConfig, ctx: WorkerContext, *, replica: int, resume: bool, writes: Any,
                   restarted: bool) -> HealingStore:
    """The group that ``writes()`` a checkpoint (:meth:`Reporter.checkpoints`) writes it, each of
    its processes its own rows (ZeRO) under the model's names, so every group reads them back and
    a resume reshards as plain DataParallel's."""
    s, run_dir = job.strategy, run_dir_of(job)
    assert isinstance(s, DataParallel)
    disk = RankStore(run_dir, "dp", rank=ctx.rank, world=ctx.world_size, group=ctx.group,
                     layout={"replicas": s.num_replicas, "shard": s.shard}, layout_field="strategy.num_replicas",
                     device=ctx.device, reshard=True)
    agree: Any = bool
    if ctx.world_size > 1:  # the processes of a group take the same way (each reads the run folder)
        def agree(flag: bool) -> bool:
            return C.all_min_ints([-int(flag)], group=ctx.group)[0] < 0
    return HealingStore(disk, writes=writes, resume=resume,
                        ended=(lambda: _ended(run_dir)) if restarted else None, agree=agree)


def _engine(job: JobConfig, ctx: WorkerContext, model: Any, task: Any, test: Any, quorum: ft.ReplicaGroup,
            evaluates: Any) -> tuple[FaultTolerantEngine | FaultTolerantZeroEngine, Any]:
    """The group's step (a whole replica, or ZeRO over the group's processes) and the
    optimizer over what this process steps."""
    s, t = job.strategy, job.train
    assert isinstance(s, DataParallel)
    if ctx.world_size == 1:
        return (FaultTolerantEngine(model, task, test, device=ctx.device, precision=t.precision, quorum=quorum,
                                    evaluates=evaluates), build_optimizer(model.parameters(), t.optimizer))
    zero = FaultTolerantZeroEngine(
        model, task, test, ctx=ctx, precision=t.precision, level=s.shard, units=s.shard_unit, local=set(),
        buffers=_shared_buffers(model, job, s), counter=C.CommCounter(),
        bucket_bytes=B.bucket_bytes_of(job.comm.bucket_size_mb), quorum=quorum, evaluates=evaluates)
    return zero, build_optimizer(zero.model.parameters(), t.optimizer)


def _finish(job: JobConfig, ctx: WorkerContext, replica: int, trainer: FaultTolerantTrainer, result: Any,
            store: HealingStore, *, model: Any, data: tuple[Any, Any, Any], started: float,
            restart_count: int) -> None:
    """The group's records: ``replica-<g>.json`` (its digest, restarts, heal), and the model
    and summary from the :class:`Reporter` (its process 0)."""
    engine, run_dir, (task, train, test) = trainer.engine, run_dir_of(job), data
    zero: dict[str, Any] = {}
    if isinstance(engine, ZeroEngine):
        zero = {**engine.describe(), "held_bytes": engine.held_bytes(trainer.optimizer)}  # before gathering
        engine.gather_all()  # ZeRO-3: the whole parameters (collective over the group)
    n = job.strategy.num_replicas  # type: ignore[union-attr]
    summary = {"strategy": "DataParallel", "aggregation": "AllReduce", "num_replicas": n, "backend": "gloo",
               "processes_per_group": ctx.world_size, "run_dir": str(run_dir), **zero,
               **summary_fields(result, task, train=train, test=test, model=model, started=started),
               "restart_count": restart_count}
    if ctx.rank != 0:
        return
    if trainer.reporter():
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


def _prepare(job: JobConfig, shard: int, resume: bool) -> Any:
    """After the first quorum: group 0's process 0 (shard 0) makes the run folder (job.json)."""
    def prepare() -> None:
        if shard == 0:
            prepare_run_dir(job, resume=resume)
    return prepare


def _error_file(run_dir: Path, replica: int, rank: int = 0) -> Path:
    """Where process ``rank`` of group ``replica`` leaves a failure no restart mends."""
    return run_dir / (f".replica-{replica}-error.json" if rank == 0 else f".replica-{replica}.{rank}-error.json")


def group_main(job_json: dict[str, Any], resume: bool, replica: int, lighthouse: str, start_line: str | None,
               restart_count: int, parent: ParentState, member: ft.Member) -> None:
    """Entry of a replica group's process ``member`` (module-level: the forkserver pickles it by name).
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
                    restart_count=restart_count, member=member)
    except RunEnded:
        pass
    except Exception as e:  # noqa: BLE001 - the supervisor reads the exit code and this record
        append_worker_log(job, replica, f"replica group {replica} (process {member.rank} of {member.size}), "
                                        f"attempt {restart_count}: {traceback.format_exc()}")
        fatal = isinstance(e, ConfigError | ft.QuorumTimeout)
        code = FATAL_EXIT if fatal else 1
        if fatal:
            problems = e.problems if isinstance(e, ConfigError) else [["", str(e)]]
            _error_file(run_dir, replica, member.rank).write_text(json.dumps(
                {"config": isinstance(e, ConfigError), "problems": problems}))
    exit_process(code)


def _fatal(run_dir: Path) -> Any:
    """The supervisor's reading of a group's failure: its ConfigError or WorkerError."""
    def fatal(replica: int, rank: int, code: int) -> BaseException | None:
        path = _error_file(run_dir, replica, rank)
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
    """Start the Lighthouse (``lighthouse = "start"``) and the ``processes_per_group``
    processes of each replica group, restart a group that dies, whole (``run.max_restarts``
    times each), return the summary with each group's restarts and digest once every
    process ended."""
    s, fto = validate(job), job.fault_tolerance
    assert fto is not None
    if in_torchrun():
        raise ConfigError([("fault_tolerance", "paratrain run starts the replica groups itself "
                                               "(fault_tolerance.processes_per_group processes each); "
                                               "run the job without torchrun")])
    task, train, _ = _load_task(job)
    validate(job, num_train=None if is_stream(train) else len(train))
    task.build_model(job.model, train)
    shard_layout(job)  # ZeRO's units resolve on the model (ConfigError before any process starts)
    n, k, job_json = s.num_replicas // fto.processes_per_group, fto.processes_per_group, job.to_json_dict()
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
                preload=[__name__], on_restart=_restarted(restarted_at), on_lost=lambda g: _lost(run_dir, g).touch(),
                processes=k)
    restarts = [started.get(g, 0) for g in range(n)]
    if not (run_dir / "summary.json").exists():  # the Reporter died after the last step
        raise RuntimeError(f"no replica group wrote the summary: the one to write it (the lowest-numbered "
                           f"group of the last step's quorum) failed after that step (restarts {restarts}); "
                           f"the last checkpoint is in {run_dir / 'checkpoints'}")
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
    run`` did not start, ``fault_tolerance.groups``, or one that left) in processes of its own
    (``processes_per_group``) until the job ends: it heals from a live peer at its first quorum and walks its own shard
    from there. Returns its ``replica-<g>.json`` record (None: the job had ended)."""
    fto, run_dir = job.fault_tolerance, run_dir_of(job)
    if fto is None:
        raise ConfigError([("fault_tolerance", "the job has no [fault_tolerance] table: no replica group to join")])
    k = fto.processes_per_group
    n = validate(job).num_replicas // k
    if not 0 <= replica < n:
        raise ConfigError([("strategy.num_replicas", f"replica group {replica} is not one of the job's "
                                                     f"{n} groups (0 to {n - 1})")])
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
                 max_restarts=job.run.max_restarts, fatal=_fatal(run_dir), preload=[__name__], processes=k)
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
