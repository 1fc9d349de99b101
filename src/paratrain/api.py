"""Python API: ``paratrain.fit(...)`` returns the same summary the CLI writes.

What ``fit`` is given is what it trains, or a ConfigError naming ``data``/``model``/``task``
says why not (never a silent fallback to the job's data; the forms: docs/running.md). Local
(no tensor parallelism) trains the objects themselves; a strategy with worker processes gets
them pickled into a temporary folder that the job names through the factories below
(``model.factory = "paratrain.api:saved_model"``, ...), so an object must pickle and its
class be importable in a fresh process (else the error names the field).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from .config import ConfigError
from .config.job import JobConfig, load_job
from .data import DataBundle

OBJECTS_ENV = "PARATRAIN_FIT_OBJECTS"  # the folder of fit's pickled instances (workers read it)


def _section(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, dict):  # e.g. subgraphs={"head": Local()}
        return {k: _section(v) for k, v in value.items()}
    return value


def _is_array(v: Any) -> bool:
    import numpy as np

    return isinstance(v, torch.Tensor | np.ndarray) or (isinstance(v, list | tuple) and not isinstance(v, str))


def _shapes(train: Dataset[Any]) -> tuple[tuple[int, ...], int]:
    """``(input_shape, num_classes)`` of a training set as far as it tells them (0 classes:
    a model or task instance builds the model)."""
    vocab = getattr(train, "vocab_size", None)
    if isinstance(train, TensorDataset) and len(train.tensors) == 2:
        x, y = train.tensors
        if y.is_floating_point():
            classes = int(y.shape[1]) if y.dim() == 2 else 1
        else:
            classes = int(y.max()) + 1 if len(y) else 1
        return tuple(x.shape[1:]), int(vocab) if vocab is not None else classes
    item = train[0] if len(train) else None  # type: ignore[arg-type]
    first = item[0] if isinstance(item, tuple | list) and item else item
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
    return shape, int(vocab) if vocab is not None else 0


def _pair_bundle(train: Dataset[Any], test: Dataset[Any]) -> DataBundle:
    shape, classes = _shapes(train)
    return DataBundle(train=train, test=test, num_classes=classes, input_shape=shape)  # type: ignore[arg-type]


def _split_dataset(ds: Dataset[Any], *, fraction: float, seed: int) -> DataBundle:
    """``ds`` split into train and test (``fraction`` of it, at least one example each),
    seeded; a ``TensorDataset`` stays one."""
    n = len(ds)  # type: ignore[arg-type]
    if n < 2:
        raise ConfigError([("data", f"the Dataset has {n} examples: a train/test split needs two")])
    n_test = min(max(1, round(n * fraction)), n - 1)
    g = torch.Generator().manual_seed(seed)
    if isinstance(ds, TensorDataset):
        perm = torch.randperm(n, generator=g)
        tr, te = perm[n_test:], perm[:n_test]
        return _pair_bundle(TensorDataset(*(t[tr] for t in ds.tensors)),
                            TensorDataset(*(t[te] for t in ds.tensors)))
    train, test = torch.utils.data.random_split(ds, [n - n_test, n_test], generator=g)
    for part in (train, test):  # a language-model set's vocabulary travels with its parts
        if hasattr(ds, "vocab_size"):
            part.vocab_size = ds.vocab_size  # type: ignore[attr-defined]
    return _pair_bundle(train, test)


def data_bundle(data: Any, cfg: JobConfig, *, regression: bool) -> DataBundle:
    """What ``fit(data=...)`` trains on (module docstring); ConfigError naming ``data``."""
    from .data.datasets import split_arrays, split_regression

    seed, fraction = cfg.run.seed, cfg.data.test_fraction
    if isinstance(data, DataBundle):
        return data
    if isinstance(data, Dataset):
        return _split_dataset(data, fraction=fraction, seed=seed)
    if isinstance(data, tuple | list) and len(data) == 2:
        a, b = data
        if isinstance(a, Dataset) and isinstance(b, Dataset):
            if len(a) < 1 or len(b) < 1:  # type: ignore[arg-type]
                raise ConfigError([("data", "the (train, test) Datasets must not be empty")])
            return _pair_bundle(a, b)
        if _is_array(a) and _is_array(b):
            x = a.numpy() if isinstance(a, torch.Tensor) else a
            y = b.numpy() if isinstance(b, torch.Tensor) else b
            try:
                split = split_regression if regression else split_arrays
                return split(x, y, test_fraction=fraction, seed=seed)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:
                raise ConfigError([("data", f"(X, y) arrays do not split: {e}")]) from None
    raise ConfigError([("data", f"fit takes data as a dataset name, a [data] dict, a DataBundle, "
                                f"(X, y) arrays, a torch Dataset or a (train, test) pair of "
                                f"Datasets (got {type(data).__name__})")])


def _load(name: str) -> Any:
    folder = os.environ.get(OBJECTS_ENV)
    if not folder or not (Path(folder) / name).is_file():
        raise ConfigError([(name.split(".")[0], f"the object paratrain.fit pickled is gone ({OBJECTS_ENV}"
                                                f"={folder!r}): these factories serve a running fit only")])
    return torch.load(Path(folder) / name, weights_only=False)


def saved_model(**_: Any) -> nn.Module:
    """The ``nn.Module`` given to :func:`fit`, a fresh copy per call (a ``[model] factory``)."""
    return _load("model.pt")  # type: ignore[no-any-return]


def saved_data(**_: Any) -> DataBundle:
    """The data given to :func:`fit` (a ``[data] factory`` returning a DataBundle)."""
    return _load("data.pt")  # type: ignore[no-any-return]


class _WithData:
    """A task whose datasets are the ones :func:`fit` was given (everything else the task's)."""

    def __init__(self, task: Any, bundle: DataBundle) -> None:
        self._task, self._bundle = task, bundle

    def datasets(self, seed: int) -> tuple[Any, Any]:
        del seed
        return self._bundle.train, self._bundle.test

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def saved_task(**_: Any) -> Any:
    """The Task given to :func:`fit` (a ``[task] factory``), over fit's data when it got some."""
    task = _load("task.pt")
    folder = Path(os.environ.get(OBJECTS_ENV, ""))
    return _WithData(task, _load("data.pt")) if (folder / "data.pt").is_file() else task


@contextlib.contextmanager
def _saved(objects: dict[str, Any], strategy: str) -> Iterator[None]:
    """Pickle ``objects`` (``"model"``/``"data"``/``"task"``) for the workers; the folder and
    the environment key are removed on exit."""
    folder = tempfile.mkdtemp(prefix="paratrain-fit-")
    before = os.environ.get(OBJECTS_ENV)
    try:
        for name, obj in objects.items():
            cls = type(obj)
            if cls.__module__ == "__main__" and not hasattr(__import__("__main__"), "__file__"):
                raise ConfigError([(name, f"{cls.__name__} is defined interactively (__main__): "
                                          f"the {strategy} workers cannot import it; define it in "
                                          f"a module or give a {name} factory ('module:function')")])
            try:
                torch.save(obj, Path(folder) / f"{name}.pt")
            except Exception as e:  # noqa: BLE001 - any pickling error: name the field
                raise ConfigError([(name, f"the {type(obj).__name__} instance cannot be pickled "
                                          f"for the {strategy} worker processes ({type(e).__name__}: "
                                          f"{e}); give a {name} factory ('module:function')")]) from None
        os.environ[OBJECTS_ENV] = folder
        yield
    finally:
        if before is None:
            os.environ.pop(OBJECTS_ENV, None)
        else:
            os.environ[OBJECTS_ENV] = before
        shutil.rmtree(folder, ignore_errors=True)


def _by_factories(doc: dict[str, Any], objects: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with each given object's section naming its factory (the section's declared
    settings kept: ``data.test_fraction``/``partition``, ``task.block_size``, ...)."""
    from .config.sections import DataSpec, ModelSpec, TaskSpec

    out = dict(doc)
    for name, spec in (("model", ModelSpec), ("data", DataSpec), ("task", TaskSpec)):
        if name not in objects or (name == "data" and "task" in objects):
            continue  # a task instance carries fit's data itself (saved_task)
        kept = {k: v for k, v in dict(doc.get(name) or {}).items()
                if k in spec.model_fields and k not in ("name", "factory")}
        out[name] = {**kept, "factory": f"paratrain.api:saved_{name}"}
    return out


def fit(
    job: JobConfig | dict[str, Any] | str | None = None,
    *,
    model: str | dict[str, Any] | nn.Module | None = None,
    data: Any = None,
    task: str | dict[str, Any] | Any = None,
    strategy: Any = None,
    resume: bool = False,
    overwrite: bool = False,
    **sections: Any,
) -> dict[str, Any]:
    """Train and return the run summary, with every check and warning ``paratrain run`` makes.

    ``job`` is a JobConfig, a dict, or a job-file path; keyword sections (``train=``,
    ``run=``, ``subgraphs=``, ...) override it. ``model``, ``data`` and ``task`` are specs or
    instances (module docstring). A run folder that already holds a run is never replaced
    implicitly: pass ``overwrite=True`` to replace it or ``resume=True`` to continue it.

    >>> summary = paratrain.fit(model="mlp", data="digits", train={"epochs": 3})
    >>> summary = paratrain.fit(model=my_net, data=(X, y), strategy={"type": "DataParallel", ...})
    """
    from .dispatch import execute

    job_dir = None
    if isinstance(job, JobConfig):
        doc: dict[str, Any] = job.model_dump(mode="json", exclude_unset=True)
    elif isinstance(job, str | Path):
        doc = load_job(str(job)).model_dump(mode="json", exclude_unset=True)
        job_dir = Path(job).resolve().parent
    else:
        doc = dict(job or {})
    instance_model = model if isinstance(model, nn.Module) else None
    instance_task = task if task is not None and not isinstance(task, str | dict) else None
    if model is not None and instance_model is None and not isinstance(model, str | dict):
        raise ConfigError([("model", f"fit takes model as a zoo name, a [model] dict or an "
                                     f"nn.Module (got {type(model).__name__})")])
    for name, value in (("task", task), ("model", model), ("data", data)):
        if isinstance(value, str):
            doc[name] = {"name": value}
        elif isinstance(value, dict):
            doc[name] = value
    if strategy is not None:
        doc["strategy"] = _section(strategy)
    for key, value in sections.items():
        doc[key] = _section(value)
    cfg = load_job(doc)
    if instance_task is not None:
        from .task import check_task

        check_task(instance_task, field="task")
    bundle = None
    if data is not None and not isinstance(data, str | dict):
        regression = cfg.task.name == "regression" and cfg.task.factory is None and instance_task is None
        if instance_task is not None and isinstance(data, tuple | list) and len(data) == 2:
            y = data[1]
            regression = bool(getattr(y, "dtype", None) is not None and str(y.dtype).startswith(("float", "torch.float")))
        bundle = data_bundle(data, cfg, regression=regression)
        if bundle.num_classes == 0 and instance_model is None:
            raise ConfigError([("data", f"a Dataset of {type(bundle.train[0]).__name__} items does not "
                                        "tell the model's input shape and outputs: give the model "
                                        "as well (model=<nn.Module>)")])
    if instance_model is None and bundle is None and instance_task is None:
        return execute(cfg, resume=resume, overwrite=overwrite, job_dir=job_dir)
    tp = cfg.tensor_parallel is not None and cfg.tensor_parallel.tensor_parallel_size > 1
    if cfg.strategy.type == "Local" and not tp:
        from .preflight import Instances

        # the objects themselves, with the same checks and warnings as a job file's run
        return execute(cfg, resume=resume, overwrite=overwrite, job_dir=job_dir,
                       instances=Instances(instance_model, bundle, instance_task))
    objects = {k: v for k, v in (("model", instance_model), ("data", bundle), ("task", instance_task))
               if v is not None}
    with _saved(objects, "tensor-parallel" if tp else str(cfg.strategy.type)):
        return execute(load_job(_by_factories(doc, objects)), resume=resume, overwrite=overwrite,
                       job_dir=job_dir)
