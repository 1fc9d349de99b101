"""What a job will actually run with, and what it sets that the run ignores.

:func:`effective_settings` knows, from the job alone, which sections and fields each
strategy reads; what only an executor's code can tell (the model it builds, a Custom
coordinator's signature) is that executor's ``ExecutorSpec.ignores``, and
:func:`paratrain.dispatch.effective_settings` is the whole report: ``paratrain validate``
prints its ``ignored`` list as warnings and ``paratrain run``
(:func:`paratrain.dispatch.execute`) warns once per run, so a setting that does nothing is
never accepted silently. This module is on the contract's floor and imports nothing above
it. Only what the user set is reported: a field counts as set when it is in
``model_fields_set`` (given explicitly) and differs from its default, so defaults never
produce a warning, nor does a job dumped in full (e.g. ``runs/<name>/job.json``, where
every field is explicit).

What is ignored, by strategy (``Custom`` excepted: its coordinator receives the whole
job, so every section is available to it and none is reported):

- ``[compression]``: compresses a gradient or update exchange, so it is read by
  DataParallel (its gradient exchange), Federated (client updates) and tensor parallelism
  with DataParallel replicas; Local, ModelParallel and PopulationBased have nothing to
  compress.
- ``[tensor_parallel]``: read by Local/DataParallel with ``tensor_parallel_size > 1``;
  size 1 runs no tensor parallelism, and ModelParallel/Federated/PopulationBased never do.
  On a tensor-parallel run: ``BlockWise`` with a non-square size runs ``ColumnWise``;
  ``memory_optimization`` and ``fusion_threshold_bytes`` without effect on the job's model
  are the tensor-parallel executor's to report
  (:mod:`paratrain.executors.tensor_parallel.ignored`).
- ``train.epochs``/``eval_every``/``max_steps``/``batch_size``: Federated counts
  ``strategy.rounds`` of ``[federated]`` local training and evaluates every round;
  PopulationBased budgets by generation (``[population]``) and evaluates every generation.
  ``run.checkpoint_every`` counts rounds under Federated (0: every round; or a wall time
  such as ``"10m"``, checked between rounds); PopulationBased ignores it: members move
  between workers through their files, so every generation is checkpointed.
- ``[federated]`` outside Federated; ``[population]``/``[search_space]`` outside
  PopulationBased.
- ``run.max_restarts``/``num_workers``/``backend``, ``[[workers]]`` and ``[comm]`` where
  the strategy's processes do not read them (:mod:`.effective_procs`).
- ``--resume`` for a Custom coordinator that takes no ``resume`` keyword (the Custom
  executor's spec: :mod:`paratrain.executors.custom`).
- Krum ``num_malicious``/``to_keep`` beyond what the clients per round allow (the
  aggregator clamps them; the effective values are given).
- Keys inside ``[strategy]``/``[compression]``/``[tensor_parallel]`` that the contract
  does not know (parsed leniently, serde style, and otherwise dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ._base import Contract, is_set, unknown_keys
from .federated_aggregation import Krum
from .strategy import Federated

if TYPE_CHECKING:
    from .job import JobConfig

__all__ = ["Effective", "Ignored", "IgnoredSettingWarning", "effective_settings", "is_set"]


class IgnoredSettingWarning(UserWarning):
    """A job sets something that the run will not use (or uses with another value)."""


@dataclass(frozen=True)
class Ignored:
    """``field`` (a job path such as ``strategy.aggregation.to_keep``) and why it is ignored."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field} ignored: {self.reason}"


@dataclass(frozen=True)
class Effective:
    """The settings the run uses (``settings``) and the user's settings it ignores."""

    settings: dict[str, Any]
    ignored: list[Ignored] = field(default_factory=list)


_set = is_set  # re-exported as is_set: the executors' own rules (ExecutorSpec.ignores) use it


def _set_fields(model: BaseModel) -> list[str]:
    return sorted(n for n in model.model_fields_set if _set(model, n))


def _unknown(obj: Any, path: str, out: list[Ignored]) -> None:
    """Unknown keys of every contract model under ``obj`` with their full paths."""
    if isinstance(obj, Contract):
        known = ", ".join(type(obj).model_fields)
        for key in unknown_keys(obj):
            out.append(Ignored(f"{path}.{key}", f"unknown key, the contract ignores it "
                                                f"(known keys here: {known})"))
        for name in type(obj).model_fields:
            _unknown(getattr(obj, name), f"{path}.{name}", out)
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            _unknown(item, f"{path}[{i}]", out)


def _clients_per_round(s: Federated) -> int | None:
    sel = s.client_selection
    n = int(s.num_clients)
    if sel.method == "All":
        return n
    if sel.method == "Random":  # as executors.federated.selection.num_random
        k = math.ceil(round(float(sel.fraction) * n, 9))
        return min(n, max(1, k))
    return None  # ByCapability: depends on tags and worker placement


def effective_settings(job: JobConfig, *, resume: bool = False) -> Effective:
    """The job's effective settings and the set-but-ignored ones that the job alone tells
    (the whole report, executors' rules included: :func:`paratrain.dispatch.effective_settings`).
    """
    from .effective_procs import ignored_process_settings

    ignored: list[Ignored] = []
    kind = str(job.strategy.type)
    tp = job.tensor_parallel
    tp_active = tp is not None and tp.tensor_parallel_size > 1 and kind in ("Local", "DataParallel")
    settings: dict[str, Any] = {
        "strategy": kind,
        "executor": "TensorParallel" if tp_active else kind,
        "resume": resume,
        "compression": _compression(job, kind, tp_active, ignored),
    }
    if job.model.leaf_modules and kind not in ("ModelParallel", "Custom"):
        ignored.append(Ignored("model.leaf_modules", f"only ModelParallel traces the model into "
                               f"a graph (and `paratrain graph`); {kind} runs it as-is"))
    settings["tensor_parallel"] = _tensor_parallel(job, kind, tp_active, ignored)
    settings.update(_budget(job, kind, ignored))
    # run.*, [[workers]], [comm]: what the processes read
    ignored += [Ignored(f, why) for f, why in ignored_process_settings(job, kind=kind, tp_active=tp_active)]
    settings.update(_strategy_sections(job, kind, ignored))
    if isinstance(job.strategy, Federated) and isinstance(job.strategy.aggregation, Krum):
        krum = _krum(job.strategy, job.strategy.aggregation, ignored)
        if krum is not None:
            settings["krum"] = krum
    _unknown(job.strategy, "strategy", ignored)
    for key, sub in sorted(job.subgraphs.items()):
        _unknown(sub, f"subgraphs.{key}", ignored)
    if job.compression is not None:
        _unknown(job.compression, "compression", ignored)
    if job.tensor_parallel is not None:
        _unknown(job.tensor_parallel, "tensor_parallel", ignored)
    return Effective(settings=settings, ignored=ignored)


def _compression(job: JobConfig, kind: str, tp_active: bool, ignored: list[Ignored]) -> dict[str, Any] | None:
    """``[compression]`` as the run uses it (None: not set, or ignored)."""
    comp = job.compression
    if comp is None:
        return None
    if kind in ("DataParallel", "Federated", "Custom"):
        used = True
    elif kind == "Local" and tp_active:
        used = comp.method != "None"  # with one replica this is a ConfigError of the tensor-parallel layout
    else:
        used = False
        why = {
            "Local": "a Local run exchanges no gradients or updates, so there is nothing "
                     "to compress",
            "ModelParallel": "ModelParallel moves activations between stages and has no "
                             "gradient exchange to compress",
            "PopulationBased": "population members train independently; nothing is "
                               "exchanged to compress",
        }[kind]
        ignored.append(Ignored("compression", why))
    return comp.model_dump(mode="json") if used else None


def _tensor_parallel(job: JobConfig, kind: str, tp_active: bool, ignored: list[Ignored]) -> dict[str, Any] | None:
    """``[tensor_parallel]`` as the run uses it (None: not set, or no tensor parallelism)."""
    tp = job.tensor_parallel
    if tp is None:
        return None
    tp_size = tp.tensor_parallel_size
    if kind in ("Federated", "PopulationBased"):  # ModelParallel refuses it (its validate)
        ignored.append(Ignored("tensor_parallel", f"{kind} runs no tensor parallelism "
                               "(it combines with Local or DataParallel only)"))
    elif tp_size == 1 and kind != "Custom":
        ignored.append(Ignored("tensor_parallel", "tensor_parallel_size = 1 runs no tensor "
                               f"parallelism: the job runs as plain {kind} and no "
                               "[tensor_parallel] key has an effect"))
    if kind == "Custom":
        return tp.model_dump(mode="json")
    if not tp_active:
        return None
    out = tp.model_dump(mode="json")
    if tp.partitioning_strategy.value == "BlockWise" and math.isqrt(tp_size) ** 2 != tp_size:
        out["partitioning_strategy"] = "ColumnWise"
        ignored.append(Ignored(
            "tensor_parallel.partitioning_strategy",
            f"BlockWise needs a square tensor_parallel_size for its g x g grid and "
            f"{tp_size} is not one, so it runs ColumnWise"))
    return out


_BUDGET_REASONS: dict[str, dict[str, str]] = {
    "Federated": {
        "train.epochs": "Federated runs strategy.rounds rounds of federated.local_epochs local epochs",
        "train.eval_every": "the global model is evaluated after every round",
        "train.max_steps": "the budget is strategy.rounds rounds",
        "train.batch_size": "clients train with federated.batch_size",
        "run.log_every": "Federated logs one record per round",
    },
    "PopulationBased": {
        "train.epochs": "a generation's budget is population.steps_per_generation or "
                        "population.epochs_per_generation",
        "train.eval_every": "members are evaluated at the end of every generation",
        "train.max_steps": "the budget is strategy.generations generations of "
                           "population.steps_per_generation/epochs_per_generation",
        "run.checkpoint_every": "PopulationBased checkpoints every generation (members "
                                "move between workers through those files; a signal "
                                "stops the run at the next generation's end)",
        "run.log_every": "PopulationBased logs one record per member per generation",
    },
}


def _budget(job: JobConfig, kind: str, ignored: list[Ignored]) -> dict[str, Any]:
    """``train`` (budget and cadence) and ``checkpoint_every`` as the run counts them:
    Federated counts rounds, PopulationBased generations."""
    train, run = job.train, job.run
    reasons = _BUDGET_REASONS.get(kind)
    if reasons is None:
        return {"train": {"epochs": train.epochs, "eval_every": train.eval_every,
                          "max_steps": train.max_steps, "batch_size": train.batch_size},
                "checkpoint_every": run.checkpoint_every}
    for path, why in reasons.items():
        section, name = path.split(".")
        if _set(train if section == "train" else run, name):
            ignored.append(Ignored(path, why))
    # Federated: a count of rounds, or a wall time between rounds
    return {"train": None, "checkpoint_every": run.checkpoint_every if kind == "Federated" else None}


def _strategy_sections(job: JobConfig, kind: str, ignored: list[Ignored]) -> dict[str, Any]:
    """``[federated]``, ``[population]``, ``[search_space]``: read by their own strategy
    (and a Custom coordinator, which receives the whole job) only."""
    custom = kind == "Custom"
    if not custom:
        for section, owner in (("federated", "Federated"), ("population", "PopulationBased"),
                               ("search_space", "PopulationBased")):
            if _set(job, section) and kind != owner:
                value = getattr(job, section)
                keys = sorted(value) if isinstance(value, dict) else _set_fields(value)
                detail = f" (set: {', '.join(keys)})" if keys else ""
                ignored.append(Ignored(section, f"only the {owner} strategy reads it{detail}"))
    out: dict[str, Any] = {section: (getattr(job, section).model_dump(mode="json")
                                     if kind == owner or custom else None)
                           for section, owner in (("federated", "Federated"), ("population", "PopulationBased"))}
    out["search_space"] = sorted(job.search_space) if kind == "PopulationBased" or custom else None
    return out


def _krum(s: Federated, agg: Krum, ignored: list[Ignored]) -> dict[str, int] | None:
    """Krum's effective ``num_malicious``/``to_keep`` for the clients a round aggregates
    (None when that number depends on tags: ByCapability)."""
    n = _clients_per_round(s)
    if n is None:
        return None
    f, keep = int(agg.num_malicious), int(agg.to_keep)
    f_eff = min(f, max(n - 3, 0))  # krum_scores: m = max(1, n - f - 2) neighbours
    keep_eff = 1 if keep == 0 else min(keep, n)
    if f_eff != f:
        ignored.append(Ignored(
            "strategy.aggregation.num_malicious",
            f"{f} with {n} client(s) per round: each score sums over "
            f"max(1, n - f - 2) = {max(1, n - f_eff - 2) if n > 1 else 0} nearest "
            f"neighbour(s), as num_malicious = {f_eff} (effective value)"))
    if keep_eff != keep and keep != 0:
        ignored.append(Ignored(
            "strategy.aggregation.to_keep",
            f"{keep} with {n} client(s) per round keeps all {n} updates (effective "
            f"to_keep = {keep_eff}): a weighted average of every update, no Krum "
            "filtering"))
    return {"clients_per_round": n, "num_malicious": f_eff, "to_keep": keep_eff}
