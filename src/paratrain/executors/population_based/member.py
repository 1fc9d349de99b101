"""A PBT member: what it can be and one generation of it (restore, apply hyperparameters,
train, evaluate, save).

What it can be: the roles of its hyperparameters (:func:`hyperparameter_roles`), the metric it
is ranked by, and the PopulationBased checks that need the factories. Model keywords may change
parameter shapes, so explore leaves them alone (sampled at the start, inherited on exploit) --
except ``dropout``, explored like the optimizer's values and set as the ``p`` of every
``nn.Dropout`` each generation (as Ray Tune's PBT re-applies a config).

A member trains the job's Task through the one loop's ``Trainer`` over a ``LocalEngine``,
so every ``[train]`` option holds as under Local; its lr schedule spans its whole life
(``generations x`` its steps per generation). It starts generation ``g + 1`` byte-identical
(:func:`state_digest`) to the end-of-``g`` state of its source, whatever process trains
either. Its hyperparameters are applied *after* ``optimizer.load_state_dict`` (which restores
the donor's values) and its ``lr`` replaces the scheduler's ``base_lrs``: explored values are
never lost (a bug class seen in other PBT systems). Every draw of its generation is seeded by
``(seed, member, generation)`` (:func:`seed_of`): no result depends on the worker count.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ...config import ConfigError
from ...config.job import ChoiceDim, DataSpec, JobConfig, ModelSpec
from ...data import DATASETS
from ...files import write_bytes
from ...models.zoo import MODELS, import_object
from ...task import Task, fetch_batch, resolve_task
from ...training import build_optimizer, checkpoint
from ...training.faults import FAULTS_ENV, injected_faults
from ...training.loop import LocalEngine, Trainer
from ...training.stepping import lr_factor
from ...training.summary import tensor_bytes
from ..plugins import keywords
from .pbt import validate_space

TRAIN_METRICS = ("train_loss",)  # besides the task's test metrics: the mean loss of its steps
_DATA_FIXED = {"seed", "test_fraction"}
_MODEL_FIXED = {"input_shape", "num_classes"}


def _builder(spec: Any, section: str, registry: Any) -> Callable[..., Any]:
    if spec.factory is not None:
        return import_object(spec.factory, field=f"{section}.factory")
    return registry.get(str(spec.name), lambda: None)


def hyperparameter_roles(job: JobConfig) -> tuple[dict[str, str], str | None]:
    """``{name: role}`` (``batch``, ``optimizer`` for any key of the optimizer's param groups,
    ``model``, ``data``, ``dropout``) for every hyperparameter a member can carry, and the
    role (``model``/``data``) whose builder takes ``**kwargs``, if any."""
    roles: dict[str, str] = {}
    probe = build_optimizer([torch.zeros(1, requires_grad=True)], job.train.optimizer)
    for k in probe.param_groups[0]:
        if k != "params":
            roles.setdefault(k, "optimizer")
    roles["batch_size"] = "batch"
    m_names, m_open = keywords(_builder(job.model, "model", MODELS), _MODEL_FIXED) or ([], True)
    d_names, d_open = keywords(_builder(job.data, "data", DATASETS), _DATA_FIXED) or ([], True)
    for k in sorted({*m_names, *job.model.kwargs}):
        roles.setdefault(k, "dropout" if k == "dropout" else "model")
    for k in sorted({*d_names, *job.data.kwargs}):
        roles.setdefault(k, "data")
    return roles, ("model" if m_open else "data" if d_open else None)


def task_metrics(task: Any) -> list[str] | None:
    """The metrics a member can be ranked by: the task's evaluation metrics (the keys its
    ``finalize`` returns, read from ``finalize`` of empty sums) and ``train_loss``; None when
    ``finalize`` cannot say (the first evaluation checks the metric then)."""
    try:
        keys = [str(k) for k in task.finalize({"count": 0.0})]
    except Exception:  # noqa: BLE001 - a user's finalize may need real sums
        return None
    return [*keys, *(m for m in TRAIN_METRICS if m not in keys)]


def task_name(task: Any) -> str:
    return str(getattr(task, "name", type(task).__name__))


def unknown_metric(metric: str, task: Any, names: list[str]) -> str:
    return (f"{metric!r} is not a metric of the {task_name(task)} task; valid: "
            f"{', '.join(names)}")


def fitness_of(job: JobConfig, task: Any) -> tuple[str, str]:
    """``(metric, mode)`` members are ranked by: ``population.metric`` or the task's
    ``fitness_metric``; ``population.mode`` or the task's ``fitness_mode``."""
    opts = job.population
    metric = opts.metric if opts.metric is not None else str(task.fitness_metric)
    mode = opts.mode if opts.mode is not None else str(task.fitness_mode)
    return metric, mode


def validate_job(job: JobConfig) -> dict[str, str]:
    """All PopulationBased checks that need the factories; returns the roles."""
    strategy = job.strategy
    if getattr(strategy, "type", None) != "PopulationBased":
        raise ConfigError([("strategy.type", f"expected PopulationBased (got {strategy.type!r})")])
    roles, open_role = hyperparameter_roles(job)
    validate_space(job.search_space, known=roles, open_names=open_role is not None)
    problems: list[tuple[str, str]] = []
    task = resolve_task(job)
    metric, _ = fitness_of(job, task)
    names = task_metrics(task)
    if names is not None and metric not in names:
        problems.append(("population.metric", unknown_metric(metric, task, names)))
    if job.task.factory is not None:
        for name in sorted(job.search_space):
            if roles.get(name) == "data":
                problems.append((f"search_space.{name}", (
                    f"{name!r} is a keyword of the data builder, which a task.factory does not "
                    "use (the task builds its own datasets)")))
    n = strategy.population_size  # type: ignore[union-attr]
    bad = sorted(i for i in injected_faults().fail_members if i >= n)
    if bad:
        problems.append((f"{FAULTS_ENV}.fail_members", f"member index {bad[0]} >= population_size {n}"))
    for name in sorted(job.search_space):  # every extreme value must build an optimizer
        if roles.get(name) != "optimizer":
            continue
        dim = job.search_space[name]
        values = dim.values if isinstance(dim, ChoiceDim) else [dim.low, dim.high]
        for v in values:
            try:
                build_optimizer([torch.zeros(1, requires_grad=True)], job.train.optimizer, **{name: v})
            except ConfigError as e:
                problems.append((f"search_space.{name}", f"{name}={v!r} is invalid: {e.problems[0][1]}"))
                break
    if problems:
        raise ConfigError(problems)
    for name in job.search_space:  # accepted by a factory's **kwargs
        roles.setdefault(name, open_role or "model")
    return roles


def member_path(run_dir: str | Path, generation: int, member: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"gen-{generation:06d}" / f"member-{member:04d}.pt"


def seed_of(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    h = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the raw bytes of the model's state and the optimizer's per-parameter
    state (momentum buffers, moments, steps), excluding param-group hyperparameters."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(tensor_bytes(t))
    state = optimizer.state_dict()["state"]
    for k in sorted(state):
        for name in sorted(state[k]):
            v = state[k][name]
            h.update(f"{k}.{name}".encode())
            h.update(tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


class CheckpointWriter:
    """Member files written atomically on one background thread, overlapped with the next
    member's training. ``save`` serialises at once (later training cannot change what is
    written); ``flush`` waits and re-raises a write error: a worker flushes before it reports
    its generation, so no rank reads a member file that is not on disk."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pbt-ckpt")
        self._pending: list[Future[None]] = []

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, data)

    def save(self, path: Path, state: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        self._pending.append(self._pool.submit(self._write, Path(path), buf.getvalue()))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()


class _Data(NamedTuple):
    task: Task
    train: Any
    test: Any


@dataclass
class _Live:
    """A member's state in memory at the end of a generation (no reload needed)."""

    generation: int
    model_key: str
    model: nn.Module
    opt: torch.optim.Optimizer
    scheduler: Any


def set_dropout(model: nn.Module, p: float) -> None:
    """The member's ``dropout``: the probability of every ``nn.Dropout`` in ``model``."""
    if not 0.0 <= p < 1.0:
        raise ConfigError([("search_space.dropout", f"dropout must be in [0, 1) (got {p})")])
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p


class MemberRunner:
    """Trains members on one worker; caches the task's datasets by their keyword arguments.
    ``states``: each of its members' state at the end of its last generation, the dict its
    file holds (what the population checkpoint saves of this worker)."""

    def __init__(self, job: JobConfig, run_dir: Path, roles: dict[str, str], device: torch.device) -> None:
        self.job, self.run_dir, self.roles, self.device = job, run_dir, roles, device
        self.task: Task = resolve_task(job)
        self.metric, self.mode = fitness_of(job, self.task)
        self._data: dict[str, _Data] = {}
        self.writer = CheckpointWriter()
        self._live: dict[int, _Live] = {}
        self.states: dict[int, dict[str, Any]] = {}

    def preload(self) -> None:
        """The dataset loaded now when no data keyword is searched (out of the timings)."""
        if not any(self.roles.get(k) == "data" for k in self.job.search_space):
            self.data({})

    def _split(self, hparams: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {"optimizer": {}, "batch": {}, "model": {}, "data": {},
                                          "dropout": {}}
        for k, v in hparams.items():
            out[self.roles.get(k, "model")][k] = v
        return out

    def data(self, data_kw: dict[str, Any]) -> _Data:
        """The task's datasets with the member's data keywords (a built-in task is rebuilt
        over the job's ``[data]`` with them; a task factory's data has none, validate_job)."""
        key = json.dumps(data_kw, sort_keys=True)
        if key not in self._data:
            task = self.task
            if data_kw:
                spec = DataSpec.model_validate({**self.job.data.model_dump(), **data_kw})
                task = resolve_task(self.job.model_copy(update={"data": spec}))
            train, test = task.datasets(self.job.run.seed)
            self._data[key] = _Data(task, train, test)
        return self._data[key]

    def reference_metrics(self) -> dict[str, float]:
        """The task's reference metrics over the job's own data (``bigram_test_loss``)."""
        ref = getattr(self.task, "reference_metrics", None)
        if not callable(ref):
            return {}
        d = self.data({})
        return {str(k): float(v) for k, v in ref(d.train, d.test).items()}

    def steps_for(self, n_train: int, batch_size: int) -> int:
        opts = self.job.population
        if opts.steps_per_generation is not None:
            return opts.steps_per_generation
        batches = math.ceil(n_train / batch_size)
        return (opts.epochs_per_generation or 1) * math.ceil(batches / self.job.train.grad_accumulation)

    def _schedule(self, total_steps: int) -> Callable[[int], float]:
        kind, warmup = str(self.job.train.lr_schedule), int(self.job.train.warmup_steps)

        def factor(step: int) -> float:
            return lr_factor(step, kind=kind, warmup_steps=warmup, total_steps=total_steps)

        return factor

    def _build(self, member: int, d: _Data, model_kw: dict[str, Any],
               opt_kw: dict[str, Any], total: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        spec = self.job.model
        if model_kw:
            spec = ModelSpec.model_validate({**spec.model_dump(), **model_kw})
        torch.manual_seed(seed_of(self.job.run.seed, member, -1))  # member's own initialisation
        model = d.task.build_model(spec, d.train)
        model.to(self.device)
        opt = build_optimizer(model.parameters(), self.job.train.optimizer, **opt_kw)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, self._schedule(total))
        return model, opt, scheduler

    @staticmethod
    def _apply(opt: torch.optim.Optimizer, scheduler: Any, opt_kw: dict[str, Any],
               factor: Callable[[int], float]) -> None:
        """The member's optimizer hyperparameters, after any load_state_dict: ``lr`` is the
        schedule's base (``base_lrs``, ``initial_lr``); every group's current lr becomes
        ``base x f(step)`` under this generation's schedule."""
        scheduler.lr_lambdas = [factor] * len(opt.param_groups)
        for i, group in enumerate(opt.param_groups):
            for k, v in opt_kw.items():
                if k != "lr":
                    group[k] = tuple(v) if isinstance(v, list) else v
            if "lr" in opt_kw:
                scheduler.base_lrs[i] = float(opt_kw["lr"])
            group["initial_lr"] = scheduler.base_lrs[i]
            group["lr"] = scheduler.base_lrs[i] * factor(scheduler.last_epoch)

    def check_resume(self, states: dict[int, dict[str, Any]], hparams: list[dict[str, Any]],
                     folder: Path) -> None:
        """On resume, before the run folder changes: a ConfigError naming what differs when the
        first member state of checkpoint ``folder`` does not fit the model and optimizer this
        job builds for that member (``hparams``: that generation's, per member)."""
        for member in sorted(states)[:1]:
            parts = self._split(hparams[member])
            model, opt, _ = self._build(member, self.data(parts["data"]), parts["model"],
                                        parts["optimizer"], 1)
            checkpoint.check_resume_state(model, opt, states[member], source=f"{folder} (member {member})")

    def restore(self, states: dict[int, dict[str, Any]], generation: int) -> None:
        """On resume: this worker's member files of ``generation`` written again from the
        population checkpoint (``keep_generations`` may have pruned them, and a fallback to
        the older checkpoint needs the generation before the newest)."""
        for member, state in states.items():
            self._save(member, member_path(self.run_dir, generation, member), state)
        self.writer.flush()

    def _save(self, member: int, path: Path, state: dict[str, Any]) -> None:
        self.writer.save(path, state)
        self.states[member] = state

    def _restore(self, member: int, generation: int, source: int | None, d: Any,
                 parts: dict[str, Any], total: int, model_key: str) -> tuple[Any, Any, Any, float]:
        """The member's model, optimizer and scheduler, and when they were ready: loaded from
        ``source``'s file of the previous generation, or kept in memory when it continues
        itself (byte-identical to that file)."""
        live = self._live.pop(member, None)
        if (live is not None and source == member and live.generation == generation - 1
                and live.model_key == model_key):
            return live.model, live.opt, live.scheduler, time.perf_counter()
        model, opt, scheduler = self._build(member, d, parts["model"], parts["optimizer"], total)
        ready = time.perf_counter()
        if source is not None:
            state = checkpoint.load_checkpoint(member_path(self.run_dir, generation - 1, source))
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            if "scheduler" in state:
                scheduler.load_state_dict(state["scheduler"])
        return model, opt, scheduler, ready

    def _train(self, member: int, generation: int, d: Any, trainer: Trainer, *, steps: int,
               batch_size: int) -> list[float]:
        """``steps`` optimizer steps on the member's own seeded order; each step's loss."""
        seed, n, t = self.job.run.seed, len(d.train), self.job.train
        g = torch.Generator().manual_seed(seed_of(seed, member, generation))
        torch.manual_seed(seed_of(seed, member, generation, 1))  # dropout etc.
        fail_at = steps // 2 if member in injected_faults().fail_members else -1
        losses: list[float] = []
        trainer.engine.model.train()
        perm, pos = torch.randperm(n, generator=g), 0
        for step in range(steps):
            if step == fail_at:
                raise RuntimeError(f"injected failure of member {member} (PARATRAIN_FAULTS fail_members)")
            batches = []
            for _ in range(t.grad_accumulation):
                if pos >= n:
                    perm, pos = torch.randperm(n, generator=g), 0
                batches.append(fetch_batch(d.train, perm[pos : pos + batch_size], self.device,
                                           collate=getattr(d.task, "collate_fn", None)))
                pos += batch_size
            losses.append(trainer.step(batches))
        return losses

    def run(self, member: int, generation: int, hparams: dict[str, Any], source: int | None,
            lost: str | None = None) -> dict[str, Any]:
        """Train ``member`` for one generation; never raises for a member's own failure.
        ``lost``: the first failure of ``source`` that left it no state (nothing to load);
        the member then fails at once naming it (``has_state`` in the result: whether this
        member has a state file for this generation)."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {
            "member": member, "generation": generation, "source": source, "fitness": None,
            "error": None, "metrics": None, "start_digest": None, "end_digest": None,
            "applied": None, "data_s": 0.0, "setup_s": 0.0, "load_s": 0.0, "train_s": 0.0, "eval_s": 0.0,
            "save_s": 0.0, "has_state": False,
        }
        self.states.pop(member, None)  # until this generation gives it a state
        if source is not None and lost is not None:
            out["error"] = (f"no state to continue from: member {source} has had none since "
                            f"its first failure, in {lost}")
            return out
        path = member_path(self.run_dir, generation, member)
        t = self.job.train
        try:
            parts = self._split(hparams)
            d = self.data(parts["data"])
            t_data = time.perf_counter()
            out["data_s"] = t_data - t0
            bs = int(parts["batch"].get("batch_size", t.batch_size))
            steps = self.steps_for(len(d.train), bs)
            total = int(self.job.strategy.generations) * steps  # type: ignore[union-attr]
            factor = self._schedule(total)
            model_key = json.dumps(parts["model"], sort_keys=True)
            model, opt, scheduler, t_setup = self._restore(member, generation, source, d, parts,
                                                           total, model_key)
            out["setup_s"] = t_setup - t_data
            if "dropout" in parts["dropout"]:
                set_dropout(model, float(parts["dropout"]["dropout"]))
            self._apply(opt, scheduler, parts["optimizer"], factor)
            out["applied"] = _applied(opt, scheduler)
            out["start_digest"] = state_digest(model, opt)
            t1 = time.perf_counter()
            out["load_s"] = t1 - t_setup

            engine = LocalEngine(model, d.task, d.test, device=self.device, precision=t.precision)
            trainer = Trainer(engine, opt, t, total, scheduler=scheduler)
            losses = self._train(member, generation, d, trainer, steps=steps, batch_size=bs)
            t2 = time.perf_counter()
            out["train_s"] = t2 - t1
            ev = engine.evaluate() or {}
            metrics: dict[str, Any] = {**{str(k): float(v) for k, v in ev.items()},
                                       "train_loss": sum(losses) / max(len(losses), 1),
                                       "steps": steps, "batch_size": bs}
            out["metrics"] = metrics
            t3 = time.perf_counter()
            out["eval_s"] = t3 - t2
            if self.metric not in metrics or self.metric in ("steps", "batch_size"):
                names = [*ev, *TRAIN_METRICS]
                raise ConfigError([("population.metric", unknown_metric(self.metric, d.task, names))])
            out["end_digest"] = state_digest(model, opt)
            self._save(member, path, _member_state(model, opt, scheduler, member, generation, hparams,
                                                   out["end_digest"]))
            out["save_s"] = time.perf_counter() - t3
            out["has_state"] = True
            self._live[member] = _Live(generation, model_key, model, opt, scheduler)
            value = float(metrics[self.metric])
            if math.isfinite(value):
                out["fitness"] = value
            else:
                out["error"] = f"non-finite {self.metric} ({value})"
        except ConfigError:
            raise  # bad input is everyone's problem, not a member failure
        except Exception as e:  # noqa: BLE001 - a failing member gets the worst fitness
            out["error"] = f"{type(e).__name__}: {e}"
            # keep the state it started from (its source's, if any): the population stays whole
            with contextlib.suppress(OSError, checkpoint.CheckpointError):
                if source is not None:
                    self._save(member, path, checkpoint.load_checkpoint(
                        member_path(self.run_dir, generation - 1, source)))
                    out["has_state"] = True
        return out


def _applied(opt: Any, scheduler: Any) -> dict[str, Any]:
    """The optimizer settings a member trains with (``lr`` its hyperparameter, ``lr_now`` the step's)."""
    applied = {k: (list(v) if isinstance(v, tuple) else v)
               for k, v in opt.param_groups[0].items() if k not in ("params", "initial_lr")}
    applied["lr"] = scheduler.base_lrs[0]
    applied["lr_now"] = opt.param_groups[0]["lr"]
    return applied


def _member_state(model: Any, opt: Any, scheduler: Any, member: int, generation: int,
                  hparams: dict[str, Any], digest: str) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": scheduler.state_dict(), "member": member, "generation": generation,
            "hparams": json.dumps(hparams), "digest": digest}
