"""How each strategy runs: one package (or module) per executor, each exporting its
:class:`~paratrain.executors.spec.ExecutorSpec` as ``SPEC``, imported on first lookup (a
strategy's dependencies load only when a job uses it). The floors above reach the executors
through this module's names only; running a job is :func:`paratrain.dispatch.execute`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig
from .custom import coordinator, register_coordinator, registered_coordinators
from .plugins import import_plugins, keywords
from .spec import ExecutorSpec, Traced

__all__ = ["Traced", "coordinator", "import_plugins", "keywords",  # re-exported
           "register_coordinator", "registered_coordinators"]

TENSOR_PARALLEL = "TensorParallel"

# executor name -> the package (module) exporting its SPEC; the strategy types first
_PACKAGES: dict[str, str] = {
    "Local": "paratrain.executors.local",
    "DataParallel": "paratrain.executors.data_parallel",
    "ModelParallel": "paratrain.executors.model_parallel",
    "Federated": "paratrain.executors.federated",
    "PopulationBased": "paratrain.executors.population_based",
    "Custom": "paratrain.executors.custom",
    TENSOR_PARALLEL: "paratrain.executors.tensor_parallel",
}
STRATEGIES = tuple(k for k in _PACKAGES if k != TENSOR_PARALLEL)
# Executors that run in the caller's process: nothing to preload for workers.
_IN_PROCESS = ("Local", "Custom")
# What loading a built-in data set imports (paratrain.data), for the workers' forkserver.
_DATA_MODULES: dict[str, tuple[str, ...]] = {
    "digits": ("paratrain.data.datasets",),  # read and split without scikit-learn
    "diabetes": ("sklearn.datasets",),
    "shakespeare": ("paratrain.data.shakespeare",),
}
# What building a zoo model imports beyond torch: transformers' model base (3-7 s of CPU per
# process on 2 cores, paid once by the server instead of by every rank).
_MODEL_MODULES: dict[str, tuple[str, ...]] = {"hf": ("transformers.modeling_utils",)}


def executor_name(job: JobConfig) -> str:
    """The executor that runs ``job``: its strategy type, or ``TensorParallel`` for a
    Local or DataParallel job with ``tensor_parallel_size > 1``; ConfigError for a type
    this version cannot run."""
    kind = str(getattr(job.strategy, "type", None))
    tp = job.tensor_parallel
    if tp is not None and tp.tensor_parallel_size > 1 and kind in ("Local", "DataParallel"):
        return TENSOR_PARALLEL
    if kind not in STRATEGIES:
        raise ConfigError(
            [("strategy.type", f"this version cannot run {kind!r}; valid: {', '.join(STRATEGIES)}")]
        )
    return kind


def spec_for(job: JobConfig) -> ExecutorSpec:
    """The spec of the executor that runs ``job`` (:func:`executor_name`)."""
    spec: ExecutorSpec = importlib.import_module(_PACKAGES[executor_name(job)]).SPEC
    return spec


def join_group(job: JobConfig, group: int) -> dict[str, Any] | None:
    """``paratrain run --join-group G``: replica group ``group`` of the running fault-tolerant
    (DataParallel) ``job``, until it ends (``data_parallel.fault_tolerance.join_group``)."""
    result: dict[str, Any] | None = importlib.import_module(
        "paratrain.executors.data_parallel.fault_tolerance").join_group(job, group)
    return result


def worker_preload(job: JobConfig) -> list[str]:
    """Modules every launched worker of ``job`` imports, for the forkserver to import once
    (:func:`paratrain.comm.forkserver.warm`); none for a job run in this process or under
    torchrun. A factory's module is left out: the server imports before it has the job's
    working directory, and an import raising anything but ImportError would end it."""
    from ..comm.rendezvous import in_torchrun

    try:
        name = executor_name(job)
    except ConfigError:
        return []
    if name in _IN_PROCESS or in_torchrun():
        return []
    data = () if job.data.factory is not None else _DATA_MODULES.get(str(job.data.name), ())
    model = () if job.model.factory is not None else _MODEL_MODULES.get(str(job.model.name), ())
    return ["paratrain.executors.entry", _PACKAGES[name], "paratrain.comm.dcp", "torch._dynamo", *data, *model]
