"""The one training loop. Every strategy trains through it; an executor supplies only an
engine (a :class:`LocalEngine`: its gradients, evaluation and own state) and its data (a
:class:`DataPlan`: replica ``r`` of ``n`` takes ``perm[: (N // n) * n][r::n]`` of
:func:`epoch_permutation`, what ``DistributedSampler(shuffle=False, drop_last=True)`` yields
over ``perm``). Position ``(step, epoch, batch)``; a step takes ``train.grad_accumulation`` batches
(:class:`Trainer`); checkpoints, signals and progress are the :class:`~.lifecycle.Lifecycle`'s.
A checkpoint holds everything a step depends on, so a resumed run's final parameters are
bit-identical (tested per strategy). The training curve (:class:`TrainCurve`) is a ``"kind":
"train"`` record every ``run.log_every`` steps from floats the step already returns (no host
synchronisation per step); its window is checkpointed, so a resume logs the same records.
"""

from __future__ import annotations

import functools
import itertools
import math
import resource
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..data.loader import (
    IN_PROCESS,
    Feed,
    LoaderOptions,
    MapFeed,
    StreamFeed,
    is_stream,
    rng_state,
    set_rng_state,
)
from . import checkpoint
from .lifecycle import Lifecycle, agree
from .reshard import ReshardWarning, by_examples, param_keys, param_names, repeated_batches
from .rundir import MetricsWriter, read_metrics
from .stepping import (
    autocast,
    build_scheduler,
    clip_coefficient,
    clip_gradients_,
    local_grad_sq_norm,
)
from .summary import summary_fields as summary_fields

Batch = Any  # a pytree of tensors (paratrain.task.steps): a tuple, a dict, a tensor, ...


def batch_size_of(batch: Batch) -> int:
    """The examples in ``batch`` (a pytree): :func:`paratrain.task.steps.batch_rows`."""
    from ..task.steps import batch_rows

    return batch_rows(batch)


def epoch_permutation(n: int, *, seed: int, epoch: int) -> torch.Tensor:
    """A fresh permutation of ``range(n)`` per epoch, a pure function of (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass(frozen=True)
class DataPlan:
    """``order(epoch)``: the dataset indices this process walks that epoch, in batches of
    ``batch_size``; a stream is read by rank ``shard[0]`` of ``shard[1]`` as one "epoch" of
    ``max_steps`` steps."""

    dataset: Any
    order: Callable[[int], torch.Tensor]
    examples_per_epoch: int
    batch_size: int
    accumulation: int
    epochs: int
    max_steps: int | None
    device: torch.device | None = None
    loader: LoaderOptions = IN_PROCESS
    shard: tuple[int, int] = (0, 1)

    @classmethod
    def build(cls, *, dataset: Any, order: Callable[[int], torch.Tensor], examples_per_epoch: int,
              batch_size: int, accumulation: int, epochs: int, max_steps: int | None,
              device: torch.device | None = None, loader: LoaderOptions = IN_PROCESS,
              shard: tuple[int, int] = (0, 1)) -> DataPlan:
        """The plan; a stream needs ``train.max_steps``."""
        if is_stream(dataset):
            if max_steps is None:
                raise ConfigError([("train.max_steps", "the training data is a stream (an "
                                    "IterableDataset, no len()): a run over it counts steps, "
                                    "not epochs; set train.max_steps")])
            examples_per_epoch, epochs = max_steps * accumulation * batch_size, 1
        return cls(dataset, order, examples_per_epoch, batch_size, accumulation, epochs,
                   max_steps, device, loader, shard)

    @property
    def stream(self) -> bool:
        return is_stream(self.dataset)

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.examples_per_epoch / self.batch_size)

    @property
    def total_steps(self) -> int:
        total = self.epochs * math.ceil(self.batches_per_epoch / self.accumulation)
        return total if self.max_steps is None else min(total, self.max_steps)


@dataclass
class Position:
    step: int = 0
    epoch: int = 0
    batch: int = 0


def feed_of(plan: DataPlan, task: Any) -> Feed:
    """Where the loop reads ``plan``'s batches (the task's ``collate_fn`` collates items)."""
    from ..task.steps import fetch_batch, to_device

    collate = getattr(task, "collate_fn", None)
    move = functools.partial(to_device, device=plan.device)
    if plan.stream:
        return StreamFeed(plan.dataset, batch_size=plan.batch_size, rank=plan.shard[0],
                          world=plan.shard[1], to_device=move, collate=collate,
                          options=plan.loader, device=plan.device)
    return MapFeed(plan.dataset, order=plan.order, batch_size=plan.batch_size, fetch=fetch_batch,
                   to_device=move, collate=collate, options=plan.loader, device=plan.device,
                   rank=plan.shard[0])


def log_every_of(setting: int, total_steps: int) -> int:
    """``run.log_every``, 0 resolved to about 100 records over the run."""
    return int(setting) if setting else max(1, int(total_steps) // 100)


def peak_rss_mb() -> float:
    """This process's peak resident set (MiB; Linux's ``ru_maxrss`` counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_mb(device: torch.device | None) -> float:
    """The peak memory of this process's training: CUDA's peak allocation, else the peak RSS."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


class TrainCurve:
    """The window of steps since the last training record, and that record."""

    def __init__(self, every: int, *, device: torch.device | None = None) -> None:
        self.every, self.device = every, device
        self.losses: list[float] = []
        self.samples = 0
        self._since = time.perf_counter()

    def add(self, loss: float, samples: int) -> None:
        """One optimizer step's loss (a float the step already returned) and its rows."""
        self.losses.append(loss)
        self.samples += samples

    def due(self, step: int) -> bool:
        """A record is due after ``step`` (a multiple of ``every``)."""
        return bool(self.losses) and step % self.every == 0

    def record(self, step: int, epoch: int, lr: float,
               mean_over_ranks: Callable[[float], float]) -> dict[str, Any]:
        """The record after ``step`` (collective: ``mean_over_ranks``); the window restarts."""
        now = time.perf_counter()
        n, took = len(self.losses), max(now - self._since, 1e-9)
        loss = mean_over_ranks(sum(self.losses) / n)
        rec = {"kind": "train", "step": step, "epoch": epoch, "train_loss": loss, "lr": lr,
               "steps_per_s": n / took, "samples_per_s": self.samples / took,
               "step_time_s": took / n, "memory_mb": memory_mb(self.device)}
        self.losses, self.samples, self._since = [], 0, now
        return rec

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.losses = [float(v) for v in state.get("losses", [])]
        self.samples = int(state.get("samples", 0))
        self._since = time.perf_counter()


class LocalEngine:
    """What an executor supplies to the loop (one per process), the base of every strategy's
    engine: here one process's forward under the job's precision, the task's loss, backward."""

    def __init__(self, model: nn.Module, task: Any, test: Any, *, device: torch.device,
                 precision: str = "fp32") -> None:
        self.model, self.task, self.test = model, task, test  # model: what the optimizer steps
        self.device, self.precision = device, precision

    def forward_backward(self, batch: Batch, *, weight: float, last: bool) -> float:
        """Backpropagate ``weight * loss(batch)``; return the unweighted loss where known
        (else 0.0). ``last``: the step's last batch (a strategy may exchange gradients)."""
        from ..task.steps import call_model

        del last
        with autocast(self.precision, self.device):
            loss = self.task.loss(call_model(self.task, self.model, batch), batch)
        (loss * weight).backward() if weight != 1.0 else loss.backward()
        return float(loss.detach())

    def sync(self) -> None:
        """Combine gradients across processes (after the step's last backward)."""

    def grad_sq_norm(self) -> float:
        """The squared L2 norm of the whole model's gradient (every process, same value)."""
        return float(local_grad_sq_norm(self.model.parameters()))

    def after_step(self) -> dict[str, float]:
        """Per-step metrics to log after the optimizer step (e.g. consensus distance)."""
        return {}

    def evaluate(self) -> dict[str, float] | None:
        """The task's test metrics on the logging process (None on the others)."""
        from ..task.steps import evaluate as evaluate_task

        with autocast(self.precision, self.device):
            return evaluate_task(self.model, self.task, self.test, device=self.device)

    def mean_over_ranks(self, value: float) -> float:
        """``value`` averaged over the processes that compute training losses."""
        return value

    def log_extras(self) -> dict[str, Any]:
        """Extra fields of every evaluation record (e.g. ``comm_bytes``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state, checkpointed."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class Trainer:
    """One optimizer step from a list of batches (:mod:`.stepping`): accumulate, sync,
    clip, step, schedule (also the federated client's and the PBT member's step)."""

    def __init__(self, engine: LocalEngine, optimizer: torch.optim.Optimizer, train: Any,
                 total_steps: int, *, scheduler: Any = None) -> None:
        self.engine, self.optimizer = engine, optimizer
        self.clip = train.grad_clip_norm
        # A constant schedule without warmup never moves the rate: its step only counts
        # (LambdaLR.step's Python cost ~1 ms a step in benchmarks/data_parallel.py), and
        # the counters it checkpoints are advanced by hand, so the state is the same.
        self.constant = scheduler is None and str(train.lr_schedule) == "constant" and not train.warmup_steps
        self.scheduler = scheduler if scheduler is not None else build_scheduler(optimizer, train, total_steps)

    def step(self, batches: Sequence[Batch]) -> float:
        """One optimizer step over ``batches``; returns their size-weighted mean loss."""
        loss = self.gradients(batches)
        self.apply()
        return loss

    def gradients(self, batches: Sequence[Batch]) -> float:
        """The step's combined gradients in ``.grad`` (accumulated, synced); its loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate(batches)
        self.engine.sync()
        return loss

    def accumulate(self, batches: Sequence[Batch]) -> float:
        """Add ``sum_b (n_b / N) grad loss(b)`` to ``.grad``; return that weighted mean loss."""
        sizes = [batch_size_of(b) for b in batches]
        total = sum(sizes)
        loss = 0.0
        for i, (b, n) in enumerate(zip(batches, sizes, strict=True)):
            w = n / total
            loss += w * self.engine.forward_backward(b, weight=w, last=i == len(batches) - 1)
        return loss

    def apply(self) -> None:
        """Clip, step the optimizer and the schedule with the gradients in ``.grad``."""
        if self.clip is not None:
            clip_gradients_(self.engine.model.parameters(),
                            clip_coefficient(self.engine.grad_sq_norm(), self.clip))
        self.optimizer.step()
        if self.constant:
            self.scheduler.last_epoch += 1
            self.scheduler._step_count += 1
        else:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


@dataclass
class LoopResult:
    position: Position
    final: dict[str, float] | None
    best: float | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoopRun:
    """What :func:`run_loop` trains, and how.

    ``store``: a :class:`~.stores.RankStore`; ``prepare()`` runs after a resumed state was
    checked and loaded, before anything is written; ``check_state(state, source)`` raises
    when the state is not this job's. ``group``: the processes that run this loop together
    (None: one process). ``layout``: this run's processes and placement, saved with every
    checkpoint; ``reposition(old_layout, position)`` moves the data position onto this
    layout (default: by the examples walked, :func:`.reshard.by_examples`)."""

    trainer: Trainer
    plan: DataPlan
    task: Any
    store: Any
    label: str
    metrics: MetricsWriter | None
    resume: bool
    prepare: Callable[[], object] | None = None
    eval_every: int = 0
    checkpoint_every: int | str = 0
    rank: int = 0
    restart_count: int = 0
    started: float | None = None
    group: Any = None
    check_state: Callable[[dict[str, Any], Any], None] | None = None
    layout: dict[str, Any] | None = None
    reposition: Callable[[dict[str, Any], Position], Position] | None = None
    progress_every: int | str | None = None
    log_every: int = 0

    @staticmethod
    def settings(job: Any) -> dict[str, Any]:
        """The job's cadences, as LoopRun's fields."""
        return {"eval_every": job.train.eval_every, "checkpoint_every": job.run.checkpoint_every,
                "progress_every": job.run.progress_every, "log_every": job.run.log_every}


def run_loop(run: LoopRun) -> LoopResult:
    """Train ``run.plan`` from the position ``run.store`` resumes (``run.resume``) or from the
    start; evaluate, log, checkpoint; return the position and the final metrics (on the
    logging process). An engine may define ``model_names()`` (its keys -> the model's
    names) and ``model_shards()`` (its keys holding part of a tensor -> shard spec, :mod:`.reshard`)."""
    return _Loop(run).run()


class _Loop:
    def __init__(self, run: LoopRun) -> None:
        self.run_ = run
        self.started = time.perf_counter() if run.started is None else run.started
        self.eng, self.opt = run.trainer.engine, run.trainer.optimizer
        self.model = self.eng.model
        self.pos = Position()
        self.losses: list[float] = []
        self.resumed_from: dict[str, Any] | None = None  # the summary says what a resume started from
        names = getattr(self.eng, "model_names", None)
        self.names = names() if callable(names) else None
        shards = getattr(self.eng, "model_shards", None)
        self.shards = shards() if callable(shards) else None
        self.curve = TrainCurve(log_every_of(run.log_every, run.plan.total_steps),
                                device=getattr(self.eng, "device", None))
        self.feed = feed_of(run.plan, run.task)
        self.evaluated: set[int] = set()
        self.results: dict[int, dict[str, float]] = {}

    def run(self) -> LoopResult:
        # torch.distributed.checkpoint, imported here: a federated client's step needs none
        from .stores import Held

        r = self.run_
        found = (r.store.load(Held(self.model, self.opt, self.names, self.shards, r.layout))
                 if r.resume else None)
        if found is not None:
            self._resume(*found)
        if r.prepare is not None:
            r.prepare()
        start_step = self.pos.step
        self._saved_names()
        bind = getattr(r.store, "bind_state", None)  # a store that hands the live state to peers
        if bind is not None:
            bind(lambda: self._state(self.pos.step), self.pos)
        life = Lifecycle(store=r.store, unit="step", total=r.plan.total_steps, label=r.label,
                         state=self._state, checkpoint_every=r.checkpoint_every, group=r.group,
                         rank=r.rank, restart_count=r.restart_count, metrics=r.metrics,
                         progress_every=r.progress_every)
        life.begin(self.pos.step, resume=r.resume, found=found is not None)
        self.model.train()
        try:
            with life:
                self._train(life)
        finally:
            self.feed.close()
        pos = self.pos
        if self.losses or (pos.step not in self.evaluated and (pos.step > start_step or found is None)):
            self._log_eval()
        life.finish(pos.step)
        if pos.step not in self.evaluated:
            ev = self.eng.evaluate()
            if ev is not None:
                self.results[pos.step] = ev
        final = self.results.get(pos.step)
        return LoopResult(pos, final, self._best(final),
                          {"resumed_from": self.resumed_from} if self.resumed_from else {})

    def _resume(self, source: Any, state: dict[str, Any]) -> None:
        r, model = self.run_, self.model
        resharded = bool(state.get("resharded"))  # written on another layout, read by names
        if not resharded:
            (r.check_state or (lambda s, src: checkpoint.check_resume_state(model, self.opt, s, source=src)))(
                state, source)
        model.load_state_dict(state["model"])
        r.trainer.load_state_dict(state)
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        self.eng.load_state_dict(state.get("engine", {}))
        self.pos = Position(int(state["step"]), int(state["epoch"]), int(state["batch"]))
        if resharded:
            self._reposition(state.get("layout") or {})
        self.resumed_from = {
            "checkpoint": Path(source).name, "step": int(state["step"]),
            "layout": dict(state.get("layout") or {}), "resharded": resharded,
            **({"onto": dict(r.layout or {}), "reset": list(state["reset"])} if resharded else {})}
        self.losses = [float(v) for v in state.get("losses", [])]
        self.curve.load_state_dict(state.get("curve"))
        if not resharded:  # a stream's loader position (same layout only)
            self.feed.load_state_dict(state.get("loader") or {})

    def _reposition(self, old: dict[str, Any]) -> None:
        r, pos, per_epoch = self.run_, self.pos, self.run_.plan.batches_per_epoch
        layout = r.layout or {}
        again = 0 if r.reposition is not None else repeated_batches(
            old, layout, batch=pos.batch, per_epoch=per_epoch)
        self.pos = (r.reposition(old, pos) if r.reposition is not None else Position(pos.step, *by_examples(
            old, layout, epoch=pos.epoch, batch=pos.batch, per_epoch=per_epoch)))
        if again and r.rank == 0:
            warnings.warn(ReshardWarning(
                f"resumed on {int(layout.get('replicas', 1))} data replica(s) from "
                f"{int(old.get('replicas', 1))}: each continues at batch {self.pos.batch} of epoch "
                f"{self.pos.epoch}, so {again} batch(es) of train.batch_size rows the old replicas had "
                "trained on are trained on again (the position is rounded down to whole batches)"),
                stacklevel=3)

    def _saved_names(self) -> None:
        """The model's name of each saved tensor and optimizer parameter (for another layout)."""
        names, shards, model, opt = self.names, self.shards, self.model, self.opt
        self.saved_names = [names.get(k, k) if names else k for k in model.state_dict()]
        self.saved_params = param_names(model, opt, names)
        self.saved_shards = ({"shards": [shards.get(k) for k in model.state_dict()],
                              "param_shards": [shards.get(k) for k in param_keys(model, opt)]}
                             if shards else {})

    def _state(self, done: int) -> dict[str, Any]:
        pos = self.pos
        assert done == pos.step
        return {
            "model": self.model.state_dict(), **self.run_.trainer.state_dict(), "rng": rng_state(),
            "engine": self.eng.state_dict(), "step": pos.step, "epoch": pos.epoch, "batch": pos.batch,
            "loader": self.feed.state_dict(),
            "losses": list(self.losses), "curve": self.curve.state_dict(),
            "optimizer_type": type(self.opt).__name__,
            "names": self.saved_names, "param_names": self.saved_params,
            "layout": dict(self.run_.layout or {}), **self.saved_shards,
        }

    def _log_eval(self) -> dict[str, float] | None:
        eng, pos, metrics = self.eng, self.pos, self.run_.metrics
        mean_loss = eng.mean_over_ranks(sum(self.losses) / max(len(self.losses), 1))
        self.losses.clear()
        ev = eng.evaluate()
        self.evaluated.add(pos.step)
        if ev is not None:
            self.results[pos.step] = ev
        if metrics is not None and ev is not None:
            metrics.log({"step": pos.step, "epoch": pos.epoch, "train_loss": mean_loss,
                         **{f"test_{k}": v for k, v in ev.items()}, **eng.log_extras(),
                         "time_s": time.perf_counter() - self.started})
        return ev

    def _train(self, life: Lifecycle) -> None:
        plan, pos = self.run_.plan, self.pos
        total, bpe, acc = plan.total_steps, plan.batches_per_epoch, plan.accumulation
        life.show(pos.step)
        ran_out = False
        while pos.step < total and pos.epoch < plan.epochs and not ran_out:
            source = self.feed.batches(pos.epoch, pos.batch)
            while pos.batch < bpe and pos.step < total:
                stop = min(pos.batch + acc, bpe)
                batches = list(itertools.islice(source, stop - pos.batch))
                if plan.stream:  # a finite stream: every rank stops when one runs out
                    ran_out = agree(len(batches) < stop - pos.batch, False, self.run_.group)[0]
                    if ran_out:
                        break
                if self._step(batches, stop, life):
                    break

    def _step(self, batches: list[Any], stop: int, life: Lifecycle) -> bool:
        """One optimizer step and what follows it; True at the end of an epoch."""
        r, pos, eng, metrics = self.run_, self.pos, self.eng, self.run_.metrics
        plan, ce, fit = r.plan, r.eval_every, r.task.fitness_metric
        self.losses.append(last_loss := r.trainer.step(batches))
        self.curve.add(last_loss, sum(batch_size_of(b) for b in batches))
        extra = eng.after_step()
        pos.step += 1
        pos.batch = stop
        if extra and metrics is not None:
            metrics.log({"step": pos.step, **extra})
        if plan.stream:  # one epoch, its batch the stream position: ends with the run
            end_of_epoch = pos.step == plan.total_steps
        else:
            if pos.batch == plan.batches_per_epoch:
                pos.epoch, pos.batch = pos.epoch + 1, 0
            end_of_epoch = pos.batch == 0
        if self.curve.due(pos.step):
            rec = self.curve.record(pos.step, pos.epoch, self.opt.param_groups[0]["lr"], eng.mean_over_ranks)
            if metrics is not None:
                metrics.log(rec)
        if (ce and pos.step % ce == 0) or (not ce and end_of_epoch):
            ev = self._log_eval()
            if ev is not None:
                life.show(pos.step, info=f"test_{fit} {ev.get(fit, float('nan')):.4g}")
        life.show(pos.step, loss=last_loss, lr=self.opt.param_groups[0]["lr"])
        life.end_unit(pos.step, boundary=end_of_epoch)
        return end_of_epoch

    def _best(self, final: dict[str, float] | None) -> float | None:
        metrics, task = self.run_.metrics, self.run_.task
        if metrics is None or final is None:
            return None
        fit = task.fitness_metric
        pick = max if task.fitness_mode == "max" else min
        records = [r for r in read_metrics(metrics.path.parent) if r.get(f"test_{fit}") is not None]
        return pick((float(r[f"test_{fit}"]) for r in records), default=final.get(fit))
