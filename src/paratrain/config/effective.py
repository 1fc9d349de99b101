"""What a job will actually run with, and what it sets that the run ignores: the one place
that says which settings take effect, from the job alone (what only an executor's code can
tell is its ``ExecutorSpec.ignores``; :func:`paratrain.dispatch.effective_settings` is the whole
report, which ``paratrain validate`` and ``run`` print as warnings). Only what the user set is
reported (:func:`is_set`: given and not the default), so defaults never warn, nor does a job
dumped in full. ``Custom`` reports nothing: its coordinator receives the whole job. Keys the
contract does not know (parsed leniently, serde style) are reported too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    ignored += _process_settings(job, kind, tp_active)
    settings.update(_strategy_sections(job, kind, ignored))
    settings["fault_tolerance"] = _fault_tolerance(job, ignored)
    if isinstance(job.strategy, Federated) and isinstance(job.strategy.aggregation, Krum):
        krum = _krum(job.strategy, job.strategy.aggregation, ignored)
        if krum is not None:
            settings["krum"] = krum
    _unknown(job.strategy, "strategy", ignored)
    for key, sub in sorted(job.subgraphs.items()):
        _unknown(sub, f"subgraphs.{key}", ignored)
    _unknown(job.compression, "compression", ignored)  # None: nothing
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
        if is_set(train if section == "train" else run, name):
            ignored.append(Ignored(path, why))
    # Federated: a count of rounds, or a wall time between rounds
    return {"train": None, "checkpoint_every": run.checkpoint_every if kind == "Federated" else None}


def _strategy_sections(job: JobConfig, kind: str, ignored: list[Ignored]) -> dict[str, Any]:
    """``[federated]``, ``[population]``, ``[search_space]``: read by their own strategy
    (and a Custom coordinator, which receives the whole job) only."""
    out: dict[str, Any] = {}
    for section, owner in (("federated", "Federated"), ("population", "PopulationBased"),
                           ("search_space", "PopulationBased")):
        value = getattr(job, section)
        keys = sorted(value if isinstance(value, dict) else
                      (n for n in value.model_fields_set if is_set(value, n)))
        if kind not in (owner, "Custom") and is_set(job, section):
            detail = f" (set: {', '.join(keys)})" if keys else ""
            ignored.append(Ignored(section, f"only the {owner} strategy reads it{detail}"))
        used = kind in (owner, "Custom")
        out[section] = (keys if isinstance(value, dict) else value.model_dump(mode="json")) if used else None
    return out


def _fault_tolerance(job: JobConfig, ignored: list[Ignored]) -> dict[str, Any] | None:
    """``[fault_tolerance]`` (JobConfig refuses it off DataParallel AllReduce): the timings of
    the Lighthouse paratrain starts are not sent to another one, which has its own."""
    ft = job.fault_tolerance
    if ft is None:
        return None
    out = ft.model_dump(mode="json")
    if ft.lighthouse != "start":
        for name in ("join_timeout_s", "heartbeat_timeout_s", "listen"):
            if is_set(ft, name):
                ignored.append(Ignored(f"fault_tolerance.{name}", f"set on the Lighthouse "
                                       f"paratrain starts; {ft.lighthouse} runs with its own"))
            out[name] = None
    if is_set(job.comm, "bucket_size_mb") and ft.processes_per_group == 1:  # ZeRO-1 in a group buckets
        ignored.append(Ignored("comm.bucket_size_mb", "under [fault_tolerance] a step's "
                               "gradients travel as one flat all-reduce through torchft's Manager"))
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


def _process_settings(job: JobConfig, kind: str, tp_active: bool) -> list[Ignored]:
    """The process settings (``run.max_restarts``/``num_workers``/``backend``,
    ``[[workers]]``, ``[comm]``) ``job`` sets that its processes do not read (Local without
    tensor parallelism trains in this process; the reasons are the messages below)."""
    if kind == "Custom":
        return []
    run, comm, s = job.run, job.comm, job.strategy
    in_process = kind == "Local" and not tp_active
    out: list[Ignored] = []
    if in_process:
        local = "a Local run trains in this one process"
        for name, why in (
            ("max_restarts", "there are no worker processes for an elastic agent to restart"),
            ("num_workers", "it starts no worker processes"),
            ("backend", "it joins no torch.distributed process group"),
        ):
            if is_set(run, name):
                out.append(Ignored(f"run.{name}", f"{local}: {why}"))
        if job.workers:
            out.append(Ignored("workers", f"{local}: there is nothing to place on workers"))
        if is_set(comm, "timeout_s"):
            out.append(Ignored("comm.timeout_s", f"{local}: it has no process group, store "
                                                 "or rendezvous to time out"))
    elif is_set(run, "num_workers") and (kind == "DataParallel" or tp_active):
        count = ("tensor_parallel_size x strategy.num_replicas (tensor parallelism)" if tp_active
                 else "strategy.num_replicas")
        out.append(Ignored("run.num_workers", f"{kind} starts {count} processes"))

    method = getattr(getattr(s, "aggregation", None), "method", None)
    dp = kind == "DataParallel" and not tp_active
    compressed = job.compression is not None and job.compression.method != "None"
    where = ("the tensor-parallel executor reduces gradients its own way" if tp_active
             else f"{kind} has no DataParallel gradient exchange")
    replicated = kind == "ModelParallel" and any(
        getattr(sub, "type", None) == "DataParallel" for sub in (job.subgraphs or {}).values())
    # the replicated stage's gradient sum is bucketed as DataParallel's AllReduce
    buckets = (dp and method == "AllReduce" and not compressed) or replicated
    if is_set(comm, "bucket_size_mb") and not buckets:
        why = (f"only DataParallel's AllReduce without compression buckets gradients; this job "
               f"runs {method}{' with compression' if compressed else ''}" if dp else where)
        out.append(Ignored("comm.bucket_size_mb", why))
    if is_set(comm, "gossip_step") and not (dp and method == "Decentralized" and compressed):
        why = ("it applies to DataParallel's Decentralized aggregation with compression "
               f"(CHOCO-gossip); this job runs {method}{' with compression' if compressed else ''}"
               if dp else where)
        out.append(Ignored("comm.gossip_step", why))
    return out
