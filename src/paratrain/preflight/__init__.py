"""Everything a run checks before it trains, in one place (issue 13, "safe by default").

:func:`preflight` is called by ``paratrain validate`` and by :func:`paratrain.dispatch.execute`
before any executor runs, so ``validate`` accepts exactly the jobs ``run`` can start and a job
that cannot run fails before any worker process is spawned: ``run.imports`` (and a Custom
coordinator they register), ``run.device``/``run.backend`` against CUDA, the worker processes
the executor's spec declares, the task, data, model and optimizer built and run on two
training rows, ``[subgraphs]``, and the spec's ``check_data`` and
``validate``.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, one_line
from ..config.job import JobConfig
from ..executors import keywords
from ..subgraphs import check_pairings, check_paths

# Worker processes per CPU core a job may start without run.allow_oversubscribe: the
# test suite runs 4 ranks on 2 cores; beyond a few per core, gloo ranks only fight for
# the CPU (and a typo of 1000 would fork-bomb the machine).
PROCS_PER_CORE = 4

Problems = list[tuple[str, str]]


class PreflightWarning(UserWarning):
    """A setting preflight adjusts instead of refusing (e.g. a capped worker count)."""


@dataclass(frozen=True)
class Instances:
    """Objects :func:`paratrain.fit` received in place of the job's specs (Local only): an
    ``nn.Module``, a :class:`~paratrain.data.DataBundle`, a Task. Preflight checks them
    as it checks what the specs build (two examples through the model and the loss, the
    optimizer over the model's parameters, ``[subgraphs]`` paths); the executor trains them."""

    model: Any = None
    data: Any = None
    task: Any = None


def process_limit() -> int:
    """Worker processes one machine may host: ``cpu_count() x PROCS_PER_CORE``."""
    return (os.cpu_count() or 1) * PROCS_PER_CORE


def process_count(job: JobConfig) -> tuple[int, str]:
    """(worker processes the job starts, the field that sets that number), as the job's
    executor declares them (``ExecutorSpec.processes``)."""
    from ..executors import spec_for

    return spec_for(job).processes(job)


def preflight(job: JobConfig, *, job_dir: Path | None = None, warn: bool = True,
              instances: Instances | None = None) -> list[str]:
    """Check ``job`` as ``run`` would before training: one ConfigError listing every problem,
    each naming its field. ``job_dir`` is the job file's folder (relative ``run.imports``);
    ``instances`` what :func:`paratrain.fit` trains instead of the job's specs. Returns the
    settings the spec adjusts rather than refuses (its ``notes``) as warning lines; with
    ``warn`` each is also issued as a PreflightWarning."""
    problems: Problems = []
    notes: list[str] = []
    imported = _stage(problems, _imports, job, job_dir)
    _stage(problems, _device, job)
    strategy_ok = _stage(problems, _processes, job, notes)
    if imported:
        _stage(problems, _coordinator, job)
    pairings_ok = _stage(problems, check_pairings, job)
    bundle = _stage(problems, _build, job, instances) if imported else None
    if bundle is not None and pairings_ok:
        _stage(problems, check_paths, bundle.model, job)
    if bundle is not None:
        _stage(problems, _spec_check, job, "check_data", bundle)
        if strategy_ok and not problems:
            _stage(problems, _spec_check, job, "validate")
    # The checked model is garbage now; an import inside a stage (spec_for's executor
    # package) can leave cyclic garbage holding this frame, and the frame its locals: drop it
    # here, so that while `paratrain run` pauses collection (training.gcfreeze) it is freed.
    del bundle
    if warn:
        for note in notes:
            warnings.warn(note, PreflightWarning, stacklevel=2)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # each problem once, in order
    return notes


def _stage(problems: Problems, fn: Any, *args: Any) -> Any:
    """Run one check: its ConfigError problems are collected; returns its result, or
    True when it returns nothing, or None when it failed."""
    try:
        out = fn(*args)
    except ConfigError as e:
        problems.extend(e.problems)
        return None
    return True if out is None else out


def _imports(job: JobConfig, job_dir: Path | None) -> None:
    from ..executors import import_plugins

    import_plugins(list(job.run.imports), base=job_dir)


def _coordinator(job: JobConfig) -> None:
    from ..executors import coordinator

    if getattr(job.strategy, "type", None) == "Custom":
        coordinator(job)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _device(job: JobConfig) -> None:
    run = job.run
    problems: Problems = []
    if run.device == "cuda" and not _cuda():
        problems.append(("run.device", "'cuda' requested but CUDA is not available on this machine; "
                                       "use 'auto' or 'cpu'"))
    if run.backend == "nccl":
        if run.device == "cpu":
            problems.append(("run.backend", "'nccl' moves CUDA tensors only and run.device is 'cpu'; "
                                            "use 'gloo' or 'auto'"))
        elif not _cuda():
            problems.append(("run.backend", "'nccl' needs CUDA, which this machine does not have; "
                                            "use 'gloo' or 'auto'"))
    if problems:
        raise ConfigError(problems)


def _processes(job: JobConfig, notes: list[str]) -> None:
    from ..comm.rendezvous import ENV_NNODES, in_torchrun
    from ..executors import spec_for

    notes += spec_for(job).notes(job)
    n, field = process_count(job)
    if in_torchrun() or job.run.allow_oversubscribe:
        return  # torchrun chose the world; or the user lifted the limit
    try:
        nnodes = max(1, int(os.environ.get(ENV_NNODES, "1")))
    except ValueError:
        nnodes = 1
    here = math.ceil(n / nnodes)
    limit = process_limit()
    if here > limit:
        per = f" ({n} over {nnodes} machines)" if nnodes > 1 else ""
        raise ConfigError([(field, (
            f"the job would start {here} worker processes on this machine{per}, more than it can "
            f"take: {os.cpu_count() or 1} CPU cores x {PROCS_PER_CORE} = {limit}; lower it or set "
            f"run.allow_oversubscribe = true"))])


def _spec_check(job: JobConfig, name: str, *args: Any) -> None:
    """The executor spec's check ``name`` (``check_data`` against the built data, or its own
    ``validate``), when it has one."""
    from ..executors import spec_for

    check = getattr(spec_for(job), name)
    if check is not None:
        check(job, *args)


# Zoo size arguments: (kwarg, smallest value, a list of them?).
_ZOO_SIZES: dict[str, list[tuple[str, int, bool]]] = {
    "mlp": [("hidden", 1, True)],
    "cnn": [("channels", 1, True)],
    "transformer": [("d_model", 1, False), ("heads", 1, False), ("layers", 0, False), ("seq_len", 1, False)],
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _zoo_sizes(name: str, kwargs: dict[str, Any]) -> Problems:
    problems: Problems = []
    for kw, low, many in _ZOO_SIZES.get(name, []):
        if kw not in kwargs or kwargs[kw] is None:
            continue
        v = kwargs[kw]
        if many:
            if not isinstance(v, list):
                problems.append((f"model.{kw}", f"must be a list of layer sizes (got {v!r})"))
                continue
            bad = [(i, x) for i, x in enumerate(v) if not _is_int(x) or x < low]
            if bad:
                i, x = bad[0]
                problems.append((f"model.{kw}", f"layer sizes must be integers >= {low} "
                                                f"(got {x!r} at index {i} of {v!r})"))
        elif not _is_int(v) or v < low:
            problems.append((f"model.{kw}", f"must be an integer >= {low} (got {v!r})"))
    return problems


def _unknown_kwargs(fn: Any, kwargs: dict[str, Any], *, section: str, what: str,
                    skip: tuple[str, ...] = ()) -> Problems:
    """``section.<kw>`` for each kwarg ``fn`` cannot take (nothing when it has **kwargs)."""
    sig = keywords(fn, skip)
    if sig is None or sig[1]:
        return []
    valid = sig[0]
    return [(f"{section}.{kw}", f"{what} takes no option {kw!r}; valid: {', '.join(valid) or '(none)'}")
            for kw in kwargs if kw not in valid]


def _field_of(message: str, names: list[str], section: str, aliases: dict[str, str] | None = None) -> str:
    """``section.<kw>`` for the first kwarg the message mentions, else ``section``."""
    low = message.lower()
    for phrase, name in (aliases or {}).items():
        if phrase in low and name in names:
            return f"{section}.{name}"
    for name in names:
        if name.lower() in low:
            return f"{section}.{name}"
    return section


def _build(job: JobConfig, instances: Instances | None = None) -> Any:
    """Load the data, build the model with its kwargs, run it on two rows, build the
    optimizer with its kwargs; what was built: ``train``, ``test`` and ``model``."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import TensorDataset

    from ..task import is_default, preflight_task
    from ..training.gcfreeze import watch_garbage

    if instances is not None:  # fit's objects, each in place of its spec
        data, model = instances.data, instances.model
        if data is not None and model is None:  # as Local: the model spec over the bundle
            model = _model(job, data)
            watch_garbage(model)
        checked = preflight_task(job, task=instances.task, model=model,
                                 datasets=(data.train, data.test) if data is not None else None)
        _optimizer(job, checked.model)
        return checked
    if not is_default(job):  # another task: its datasets, model, two examples; the optimizer
        checked = preflight_task(job)
        watch_garbage(checked.model)  # checked, then dropped: the run builds its own
        _optimizer(job, checked.model)
        return checked

    from ..data import load_data

    try:
        bundle = load_data(job.data, seed=job.run.seed)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a user factory's own error: one line
        raise ConfigError([("data", one_line(f"loading the data failed: {type(e).__name__}: {e}"))]) from None
    model = _model(job, bundle)
    watch_garbage(model)  # checked, then dropped: the run builds its own
    if not isinstance(bundle.train, TensorDataset):  # paratrain.fit's own Datasets (its saved_data)
        checked = preflight_task(job, datasets=(bundle.train, bundle.test), model=model)
        _optimizer(job, checked.model)
        return checked
    kwargs = job.model.kwargs
    x, _ = bundle.train.tensors
    try:
        model.eval()
        with torch.no_grad():
            model(x[:2])
    except Exception as e:  # noqa: BLE001
        msg = one_line(f"the model fails on two training rows of shape {tuple(x[:2].shape)}: "
                        f"{type(e).__name__}: {e}")
        raise ConfigError([(_field_of(msg, list(kwargs), "model"), msg)]) from None
    _optimizer(job, model)
    return SimpleNamespace(train=bundle.train, test=bundle.test, model=model)


def _model(job: JobConfig, bundle: Any) -> Any:
    """The job's model spec built over ``bundle``'s shapes, its kwargs checked first."""
    from ..models import build_model
    from ..models.zoo import MODELS, import_object

    spec = job.model
    kwargs = spec.kwargs
    problems: Problems = []
    if spec.factory is not None:
        fn = import_object(spec.factory, field="model.factory")
        problems += _unknown_kwargs(fn, kwargs, section="model", what=f"factory {spec.factory!r}",
                                    skip=("input_shape", "num_classes"))
    elif spec.name in MODELS:
        problems += _unknown_kwargs(MODELS[spec.name], kwargs, section="model", what=f"model {spec.name!r}",
                                    skip=("input_shape", "num_classes"))
        problems += _zoo_sizes(str(spec.name), kwargs)
    if problems:
        raise ConfigError(problems)
    try:
        model = build_model(spec, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        msg = one_line(f"building the model failed: {type(e).__name__}: {e}")
        raise ConfigError([(_field_of(msg, list(kwargs), "model"), msg)]) from None
    return model


def _optimizer(job: JobConfig, model: Any) -> None:
    """The optimizer builds over ``model``'s parameters with its kwargs (each named)."""
    from ..training.optim import OPTIMIZERS, check_optimizer

    opt = job.train.optimizer
    unknown = _unknown_kwargs(OPTIMIZERS[opt.name], opt.kwargs, section="train.optimizer",
                              what=f"optimizer {opt.name!r}", skip=("params",))
    if unknown:
        raise ConfigError(unknown)
    try:
        check_optimizer(model.parameters(), opt)
    except ConfigError as e:
        msg = e.problems[0][1]
        names = ["lr", *opt.kwargs]
        raise ConfigError([(_field_of(msg, names, "train.optimizer", _TORCH_OPT_WORDS), msg)]) from None


# How torch's optimizers name their arguments in ValueError messages.
_TORCH_OPT_WORDS = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "weight_decay": "weight_decay",
                    "nesterov": "nesterov"}
