"""One PBT member for one generation: restore, apply hyperparameters, train, evaluate, save.

What a member trains is the job's :class:`~paratrain.task.Task` (classification by
default; regression, the language model or a user's task): its model
(``task.build_model``, with the member's model keywords), its data (``task.datasets``),
its loss and its metrics. Each optimizer step is the one loop's
:class:`~paratrain.training.loop.Trainer` over a
:class:`~paratrain.training.loop.LocalEngine`, so every ``[train]`` option holds as under
Local: ``grad_accumulation`` batches per step (weights ``n_i / N``), ``grad_clip_norm``,
``precision = "bf16"`` (autocast; fp32 parameters and optimizer state),
``optimizer.weight_decay`` and ``lr_schedule``/``warmup_steps``. The schedule runs over the
member's *whole* life, ``T = strategy.generations x`` (this generation's steps per
generation) optimizer steps; its state (the step count) travels in the member checkpoint,
so a copied member continues the donor's schedule. The member's ``lr`` hyperparameter is
the schedule's *base* learning rate: after a restore it replaces the scheduler's base
(``base_lrs``) and the group's current ``lr`` becomes ``lr x f(step)``, so an explored
``lr`` is never undone by the next ``scheduler.step()``.

Fitness: ``population.metric`` (default the task's ``fitness_metric``, mode the task's
``fitness_mode`` unless ``population.mode`` is set, :func:`fitness_of`), a metric of the
task's evaluation on its test set or ``train_loss`` (the mean loss of the generation's
steps). Every member record reports the task's metrics (``test_<metric>`` in
``metrics.jsonl``).

A member's state at the end of generation ``g`` lives in
``checkpoints/gen-<g>/member-<i>.pt`` (model, optimizer and lr-scheduler ``state_dict``,
written atomically). At generation ``g + 1`` member ``i`` loads the file of its *source*:
itself, or the donor it copied in exploit. The copy is therefore byte-identical to the
donor at that moment, whatever process trains either of them. The member's own
hyperparameters are applied *after* ``optimizer.load_state_dict`` — which restores the
donor's param-group values — so explored values are never lost (a bug class seen in
other PBT systems).

Every random draw of a member's generation is seeded by ``(seed, member, generation)``
(data order, dropout), so results do not depend on which worker runs the member, on the
number of workers, or on whether the run was resumed. A generation's batches: a fresh
permutation of the training set (seeded so) walked in batches of ``batch_size``, a new
permutation when it runs out; each optimizer step takes the next ``grad_accumulation``
batches.

Hyperparameter roles (:func:`hyperparameter_roles`): ``batch_size``; any key of the
optimizer's param groups (``lr``, ``momentum``, ``weight_decay``, ``betas``...); any
keyword of the model builder/factory (e.g. the gpt's ``dropout``: applied when the
member's model is built); any keyword of the dataset builder/factory (built-in tasks).
Model keywords may change parameter shapes, so explore leaves them alone (they are
sampled at the start and inherited on exploit).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...config import ConfigError
from ...config.job import ChoiceDim, DataSpec, JobConfig, ModelSpec
from ...data import DATASETS
from ...models.zoo import MODELS, import_object
from ...task import Task, fetch_batch, resolve_task
from ...training import build_optimizer, checkpoint
from ...training.faults import FAULTS_ENV, injected_faults
from ...training.loop import LocalEngine, Trainer
from ...training.stepping import lr_factor
from .pbt.space import validate_space

__all__ = [
    "TRAIN_METRICS", "hyperparameter_roles", "task_metrics", "fitness_of", "validate_job",
    "member_path", "state_digest", "seed_of", "MemberRunner",
]

TRAIN_METRICS = ("train_loss",)
"""Metrics a member reports besides the task's test metrics (mean loss of its steps)."""
_DATA_FIXED = {"seed", "test_fraction"}
_MODEL_FIXED = {"input_shape", "num_classes"}


def _kwargs_of(fn: Callable[..., Any], fixed: set[str]) -> tuple[set[str], bool]:
    """Keyword names ``fn`` accepts (minus ``fixed``) and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    names = {
        p.name for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed
    }
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def hyperparameter_roles(job: JobConfig) -> tuple[dict[str, str], str | None]:
    """``{name: role}`` for every hyperparameter a member can carry, and the role
    (``model``/``data``) whose factory accepts any keyword (``**kwargs``), if any.
    Roles: ``batch``, ``optimizer``, ``model``, ``data``."""
    roles: dict[str, str] = {}
    probe = build_optimizer([torch.zeros(1, requires_grad=True)], job.train.optimizer)
    for k in probe.param_groups[0]:
        if k != "params":
            roles.setdefault(k, "optimizer")
    roles["batch_size"] = "batch"
    if job.model.factory is not None:
        m_fn = import_object(job.model.factory, field="model.factory")
    else:
        m_fn = MODELS.get(str(job.model.name), lambda: None)
    m_names, m_open = _kwargs_of(m_fn, _MODEL_FIXED)
    if job.data.factory is not None:
        d_fn = import_object(job.data.factory, field="data.factory")
    else:
        d_fn = DATASETS.get(str(job.data.name), lambda: None)
    d_names, d_open = _kwargs_of(d_fn, _DATA_FIXED)
    for k in sorted(m_names | set(job.model.kwargs)):
        roles.setdefault(k, "model")
    for k in sorted(d_names | set(job.data.kwargs)):
        roles.setdefault(k, "data")
    return roles, ("model" if m_open else "data" if d_open else None)


def _task_name(task: Any) -> str:
    return str(getattr(task, "name", type(task).__name__))


def task_metrics(task: Any) -> list[str] | None:
    """The metrics a member can be ranked by: the task's evaluation metrics (the keys its
    ``finalize`` returns, read from ``finalize`` of empty sums) and ``train_loss``; None when
    ``finalize`` cannot say (the first evaluation checks the metric then)."""
    try:
        keys = [str(k) for k in task.finalize({"count": 0.0})]
    except Exception:  # noqa: BLE001 - a user's finalize may need real sums
        return None
    return [*keys, *(m for m in TRAIN_METRICS if m not in keys)]


def _unknown_metric(metric: str, task: Any, names: list[str]) -> str:
    return (f"{metric!r} is not a metric of the {_task_name(task)} task; valid: "
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
        problems.append(("population.metric", _unknown_metric(metric, task, names)))
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


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the raw bytes of the model's state and the optimizer's per-parameter
    state (momentum buffers, moments, steps), excluding param-group hyperparameters."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(_tensor_bytes(t))
    state = optimizer.state_dict()["state"]
    for k in sorted(state):
        for name in sorted(state[k]):
            v = state[k][name]
            h.update(f"{k}.{name}".encode())
            h.update(_tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class CheckpointWriter:
    """Atomic checkpoint files written in a background thread.

    ``save`` serialises the state into memory at once (later training cannot change
    what is written) and hands the bytes to one writer thread, which writes a temp file
    in the target folder, fsyncs it and ``os.replace``s it into place — the same
    guarantees as :func:`paratrain.training.checkpoint.save_checkpoint`, overlapped with
    the next member's training. ``flush`` waits for every pending file and re-raises a
    write error; a worker flushes before reporting its generation, so a population
    checkpoint never refers to a member file that is not on disk.
    """

    def __init__(self) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pbt-ckpt")
        self._pending: list[Future[None]] = []

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def save(self, path: Path, state: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        self._pending.append(self._pool.submit(self._write, Path(path), buf.getvalue()))

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the writer thread, after every file queued before it."""
        self._pending.append(self._pool.submit(fn, *args))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()


class _Data:
    """One data variant: the task that built it and its (train, test) datasets."""

    def __init__(self, task: Task, train: Any, test: Any) -> None:
        self.task, self.train, self.test = task, train, test


class _Live:
    """A member's state in memory at the end of a generation (no reload needed)."""

    def __init__(self, generation: int, model_key: str, model: nn.Module,
                 opt: torch.optim.Optimizer, scheduler: Any) -> None:
        self.generation, self.model_key = generation, model_key
        self.model, self.opt, self.scheduler = model, opt, scheduler


class MemberRunner:
    """Trains members on one worker; caches the task's datasets by their keyword arguments."""

    def __init__(self, job: JobConfig, run_dir: Path, roles: dict[str, str], device: torch.device,
                 task: Task | None = None) -> None:
        self.job = job
        self.run_dir = run_dir
        self.roles = roles
        self.device = device
        self.task: Task = task if task is not None else resolve_task(job)
        self.metric, self.mode = fitness_of(job, self.task)
        self._data: dict[str, _Data] = {}
        self.writer = CheckpointWriter()
        self._live: dict[int, _Live] = {}

    def preload(self) -> None:
        """Load the dataset now when no data keyword is searched (keeps it out of timings)."""
        if not any(self.roles.get(k) == "data" for k in self.job.search_space):
            self.data({})

    def _split(self, hparams: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {"optimizer": {}, "batch": {}, "model": {}, "data": {}}
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
        """Optimizer steps of one generation (``grad_accumulation`` batches each)."""
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

    def run(self, member: int, generation: int, hparams: dict[str, Any], source: int | None) -> dict[str, Any]:
        """Train ``member`` for one generation; never raises for a member's own failure."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {
            "member": member, "generation": generation, "source": source, "fitness": None,
            "error": None, "metrics": None, "start_digest": None, "end_digest": None,
            "applied": None, "data_s": 0.0, "setup_s": 0.0, "load_s": 0.0, "train_s": 0.0, "eval_s": 0.0,
            "save_s": 0.0,
        }
        path = member_path(self.run_dir, generation, member)
        seed = self.job.run.seed
        t = self.job.train
        try:
            parts = self._split(hparams)
            d = self.data(parts["data"])
            t_data = time.perf_counter()
            out["data_s"] = t_data - t0
            bs = int(parts["batch"].get("batch_size", t.batch_size))
            n = len(d.train)
            steps = self.steps_for(n, bs)
            total = int(self.job.strategy.generations) * steps  # type: ignore[union-attr]
            factor = self._schedule(total)
            live = self._live.pop(member, None)
            model_key = json.dumps(parts["model"], sort_keys=True)
            if (live is not None and source == member and live.generation == generation - 1
                    and live.model_key == model_key):
                # Not replaced: continue from the state in memory, byte-identical to the
                # file saved at the end of the previous generation (no reload needed).
                model, opt, scheduler = live.model, live.opt, live.scheduler
                t_setup = time.perf_counter()
            else:
                model, opt, scheduler = self._build(member, d, parts["model"], parts["optimizer"], total)
                t_setup = time.perf_counter()
                if source is not None:
                    state = checkpoint.load_checkpoint(member_path(self.run_dir, generation - 1, source))
                    model.load_state_dict(state["model"])
                    opt.load_state_dict(state["optimizer"])
                    if "scheduler" in state:
                        scheduler.load_state_dict(state["scheduler"])
            out["setup_s"] = t_setup - t_data
            self._apply(opt, scheduler, parts["optimizer"], factor)
            applied = {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in opt.param_groups[0].items() if k not in ("params", "initial_lr")}
            applied["lr"] = scheduler.base_lrs[0]  # the hyperparameter; lr_now: this step's
            applied["lr_now"] = opt.param_groups[0]["lr"]
            out["applied"] = applied
            out["start_digest"] = state_digest(model, opt)
            t1 = time.perf_counter()
            out["load_s"] = t1 - t_setup

            engine = LocalEngine(model, d.task, d.test, device=self.device, precision=t.precision)
            trainer = Trainer(engine, opt, t, total, scheduler=scheduler)
            g = torch.Generator().manual_seed(seed_of(seed, member, generation))
            torch.manual_seed(seed_of(seed, member, generation, 1))  # dropout etc.
            fail_at = steps // 2 if member in injected_faults().fail_members else -1
            losses: list[float] = []
            model.train()
            perm, pos = torch.randperm(n, generator=g), 0
            for step in range(steps):
                if step == fail_at:
                    raise RuntimeError(f"injected failure of member {member} (PARATRAIN_FAULTS fail_members)")
                batches = []
                for _ in range(t.grad_accumulation):
                    if pos >= n:
                        perm, pos = torch.randperm(n, generator=g), 0
                    batches.append(fetch_batch(d.train, perm[pos : pos + bs], self.device))
                    pos += bs
                losses.append(trainer.step(batches))
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
                raise ConfigError([("population.metric", _unknown_metric(self.metric, d.task, names))])
            out["end_digest"] = state_digest(model, opt)
            self.writer.save(path, {
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": scheduler.state_dict(), "member": member,
                "generation": generation, "hparams": json.dumps(hparams),
                "digest": out["end_digest"],
            })
            out["save_s"] = time.perf_counter() - t3
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
            out["fitness"] = None
            # Keep the state it started from so the population stays complete on disk.
            if source is not None:
                src = member_path(self.run_dir, generation - 1, source)
                if src.exists():
                    _copy_atomic(src, path)
        return out
