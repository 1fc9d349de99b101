"""The build stage of :func:`paratrain.preflight.preflight`: the data load, the model
builds with its kwargs (unknown ones and non-positive zoo widths named by field) and runs
on two training rows, and the optimizer builds over its parameters with its kwargs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import ConfigError, one_line
from ..config.job import JobConfig
from ..executors import keywords

if TYPE_CHECKING:
    from . import Instances

Problems = list[tuple[str, str]]

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
