"""One PBT member for one generation: restore, apply hyperparameters, train, evaluate, save.

A member's state at the end of generation ``g`` lives in
``checkpoints/gen-<g>/member-<i>.pt`` (model and optimizer ``state_dict``, written
atomically). At generation ``g + 1`` member ``i`` loads the file of its *source*: itself,
or the donor it copied in exploit. The copy is therefore byte-identical to the donor at
that moment, whatever process trains either of them. The member's own hyperparameters
are applied *after* ``optimizer.load_state_dict`` — which restores the donor's
param-group values — so explored values are never lost (a bug class seen in other PBT
systems).

Every random draw of a member's generation is seeded by ``(seed, member, generation)``
(data order, dropout), so results do not depend on which worker runs the member, on the
number of workers, or on whether the run was resumed.

Hyperparameter roles (:func:`hyperparameter_roles`): ``batch_size``; any key of the
optimizer's param groups (``lr``, ``momentum``, ``weight_decay``, ``betas``...); any
keyword of the model builder/factory; any keyword of the dataset builder/factory.
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
from ...data import DATASETS, DataBundle, load_data
from ...models import build_model
from ...models.zoo import MODELS, import_object
from ...training import build_optimizer, checkpoint, evaluate
from ...training.faults import FAULTS_ENV, injected_faults
from .pbt.space import validate_space


def train_step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward, cross-entropy, backward, step (the classification member's step)."""
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


__all__ = [
    "METRICS", "hyperparameter_roles", "validate_job", "member_path", "state_digest",
    "seed_of", "MemberRunner",
]

METRICS = ("accuracy", "loss", "train_loss")
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


def validate_job(job: JobConfig) -> dict[str, str]:
    """All PopulationBased checks that need the factories; returns the roles."""
    strategy = job.strategy
    if getattr(strategy, "type", None) != "PopulationBased":
        raise ConfigError([("strategy.type", f"expected PopulationBased (got {strategy.type!r})")])
    roles, open_role = hyperparameter_roles(job)
    validate_space(job.search_space, known=roles, open_names=open_role is not None)
    problems: list[tuple[str, str]] = []
    if job.population.metric not in METRICS:
        problems.append(("population.metric", f"unknown metric {job.population.metric!r}; valid: {', '.join(METRICS)}"))
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


class MemberRunner:
    """Trains members on one worker; caches datasets by their keyword arguments."""

    def __init__(self, job: JobConfig, run_dir: Path, roles: dict[str, str], device: torch.device) -> None:
        self.job = job
        self.run_dir = run_dir
        self.roles = roles
        self.device = device
        self._data: dict[str, DataBundle] = {}
        self.writer = CheckpointWriter()
        # member -> (generation, model kwargs, model, optimizer) at the end of that generation
        self._live: dict[int, tuple[int, str, nn.Module, torch.optim.Optimizer]] = {}

    def preload(self) -> None:
        """Load the dataset now when no data keyword is searched (keeps it out of timings)."""
        if not any(self.roles.get(k) == "data" for k in self.job.search_space):
            self._bundle({})

    def _split(self, hparams: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {"optimizer": {}, "batch": {}, "model": {}, "data": {}}
        for k, v in hparams.items():
            out[self.roles.get(k, "model")][k] = v
        return out

    def _bundle(self, data_kw: dict[str, Any]) -> DataBundle:
        key = json.dumps(data_kw, sort_keys=True)
        if key not in self._data:
            spec = self.job.data
            if data_kw:
                spec = DataSpec.model_validate({**spec.model_dump(), **data_kw})
            self._data[key] = load_data(spec, seed=self.job.run.seed)
        return self._data[key]

    def steps_for(self, n_train: int, batch_size: int) -> int:
        opts = self.job.population
        if opts.steps_per_generation is not None:
            return opts.steps_per_generation
        return (opts.epochs_per_generation or 1) * math.ceil(n_train / batch_size)

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
        try:
            parts = self._split(hparams)
            bundle = self._bundle(parts["data"])
            t_data = time.perf_counter()
            out["data_s"] = t_data - t0
            live = self._live.pop(member, None)
            model_key = json.dumps(parts["model"], sort_keys=True)
            if live is not None and source == member and live[0] == generation - 1 and live[1] == model_key:
                # Not replaced: continue from the state in memory, byte-identical to the
                # file saved at the end of the previous generation (no reload needed).
                model, opt = live[2], live[3]
                t_setup = time.perf_counter()
            else:
                spec = self.job.model
                if parts["model"]:
                    spec = ModelSpec.model_validate({**spec.model_dump(), **parts["model"]})
                torch.manual_seed(seed_of(seed, member, -1))  # member's own initialisation
                model = build_model(spec, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
                model.to(self.device)
                opt = build_optimizer(model.parameters(), self.job.train.optimizer, **parts["optimizer"])
                t_setup = time.perf_counter()
                if source is not None:
                    state = checkpoint.load_checkpoint(member_path(self.run_dir, generation - 1, source))
                    model.load_state_dict(state["model"])
                    opt.load_state_dict(state["optimizer"])
            out["setup_s"] = t_setup - t_data
            for group in opt.param_groups:  # after load_state_dict: the member's own values
                for k, v in parts["optimizer"].items():
                    group[k] = tuple(v) if isinstance(v, list) else v
            out["applied"] = {
                k: (list(v) if isinstance(v, tuple) else v)
                for k, v in opt.param_groups[0].items() if k != "params"
            }
            out["start_digest"] = state_digest(model, opt)
            t1 = time.perf_counter()
            out["load_s"] = t1 - t_setup

            bs = int(parts["batch"].get("batch_size", self.job.train.batch_size))
            x_train, y_train = bundle.train.tensors
            n = len(y_train)
            steps = self.steps_for(n, bs)
            g = torch.Generator().manual_seed(seed_of(seed, member, generation))
            torch.manual_seed(seed_of(seed, member, generation, 1))  # dropout etc.
            fail_at = steps // 2 if member in injected_faults().fail_members else -1
            losses: list[float] = []
            model.train()
            perm, pos = torch.randperm(n, generator=g), 0
            for step in range(steps):
                if step == fail_at:
                    raise RuntimeError(f"injected failure of member {member} (PARATRAIN_FAULTS fail_members)")
                if pos >= n:
                    perm, pos = torch.randperm(n, generator=g), 0
                idx = perm[pos : pos + bs]
                pos += bs
                losses.append(train_step(model, opt, x_train[idx].to(self.device), y_train[idx].to(self.device)))
            t2 = time.perf_counter()
            out["train_s"] = t2 - t1
            ev = evaluate(model, bundle.test, device=self.device)
            metrics = {"accuracy": ev["accuracy"], "loss": ev["loss"],
                       "train_loss": sum(losses) / max(len(losses), 1), "steps": steps,
                       "batch_size": bs}
            out["metrics"] = metrics
            t3 = time.perf_counter()
            out["eval_s"] = t3 - t2
            out["end_digest"] = state_digest(model, opt)
            self.writer.save(path, {
                "model": model.state_dict(), "optimizer": opt.state_dict(), "member": member,
                "generation": generation, "hparams": json.dumps(hparams),
                "digest": out["end_digest"],
            })
            out["save_s"] = time.perf_counter() - t3
            self._live[member] = (generation, model_key, model, opt)
            value = float(metrics[self.job.population.metric])
            if math.isfinite(value):
                out["fitness"] = value
            else:
                out["error"] = f"non-finite {self.job.population.metric} ({value})"
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
