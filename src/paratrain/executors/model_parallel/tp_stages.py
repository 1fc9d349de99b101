"""Pipeline x tensor parallelism: ``[tensor_parallel]`` inside each ModelParallel stage, and
replicated stages on top (pp x dp x tp; docs/composing.md).

The job's ``W`` logical workers (stages plus the replicated stages' extra workers) times
``T = tensor_parallel_size`` run on the mesh ``worker x tp`` (``rank = worker * T + tp``).
Every rank shards the same model over its mesh row (:func:`shard_model`) and the plan cuts the
*sharded* model (the parallel layers as leaves). The ranks of one tp index form a *lane*, a
whole pipeline running the unchanged runtime and schedule within itself; all lanes run the
same order, so each stage's TP collectives pair up (under ZBH1 the W pass repeats a TP
layer's input-gradient all-reduce: the same sum, on every lane). A replicated stage's
replicas holding the same shard (the mesh's dp groups) sum its gradients after the step's
last backward. Clipping: each rank of a stage's first replica adds ``||g||^2 / f`` per
parameter (``f`` the TP ranks holding the same tensor) and one all-reduce sums it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn

from ...comm import collectives as C
from ...comm.collectives import broadcast_module_
from ...comm.mesh import Mesh
from ...comm.tp.groups import TPGroups, build_tp_groups
from ...config import ConfigError
from ...config.job import JobConfig
from ...tensor_parallel.grid import replicas_of
from ...training.stepping import local_grad_sq_norm
from .engine import PipelineEngine, StageModel
from .plan import Replicas


def tp_size_of(job: JobConfig) -> int:
    tp = job.tensor_parallel
    return int(tp.tensor_parallel_size) if tp is not None else 1


def check_job(job: JobConfig) -> None:
    """What pipeline x TP does not run: DataStore."""
    if tp_size_of(job) > 1 and cast(Any, job.strategy).communication.protocol == "DataStore":
        raise ConfigError([("strategy.communication.protocol", (
            "DataStore passes activations through files between stages that need not be online "
            "together; tensor-parallel stages run collectives: use Pipeline or Direct"))])


def lane_replicas(logical: Replicas, workers: int, tp: int, rank: int) -> Replicas:
    """This rank's lane: stage ``s`` (a logical worker of the plan) runs on the physical ranks
    ``w*tp + (rank % tp)`` for each logical worker ``w`` of ``logical.of(s)`` (its replicas)."""
    j = rank % tp
    extra = {w for g in logical.groups.values() for w in g[1:]}  # the replicas' own workers
    return Replicas({s: tuple(w * tp + j for w in logical.of(s)) for s in range(workers) if s not in extra},
                    dict(logical.paths))


def replica_groups(logical: Replicas, tp: int) -> list[list[int]]:
    """The dp groups of the mesh: for each replicated stage (in stage order) and each tp index,
    the physical ranks of its replicas that hold the same shard."""
    return [[w * tp + j for w in logical.groups[s]] for s in sorted(logical.groups) for j in range(tp)]


def mesh_report(logical: Replicas, workers: int, tp: int) -> dict[str, Any]:
    """The mesh as ``paratrain graph`` and the summary show it."""
    if not logical.groups:
        return Mesh.of(pp=workers, tp=tp).describe()
    out: dict[str, Any] = dict(Mesh.of(worker=workers, tp=tp).describe())
    out["groups"] = {"tp": out["groups"]["tp"], "dp": replica_groups(logical, tp)}
    return out


def shard_model(job: JobConfig, model: nn.Module) -> tuple[nn.Module, TPGroups, tuple[str, ...]]:
    """The model sharded over this rank's mesh row (collective over the world), its groups
    and the paths of the modules tensor parallelism placed (traced as leaves)."""
    from ...tensor_parallel import parallelize
    from ...tensor_parallel.foreign import PackedColumnParallel
    from ...tensor_parallel.module import _PARALLEL

    cfg = job.tensor_parallel
    assert cfg is not None
    broadcast_module_(model)
    groups = build_tp_groups(cfg.tensor_parallel_size, pattern=cfg.communication_pattern.value,
                             async_op=cfg.async_communication,
                             fusion_threshold_bytes=cfg.fusion_threshold_bytes)
    try:
        tpm = parallelize(model, cfg, dataclasses.replace(groups, dp=None))
    except BaseException:
        groups.tp.close()
        raise
    inner: nn.Module = tpm.module  # type: ignore[assignment]
    # (a packed q|k|v projection is one leaf: its parts share one fused f)
    leaves = tuple(n for n, m in inner.named_modules()
                   if n and isinstance(m, (*_PARALLEL, PackedColumnParallel)))
    return inner, groups, leaves


def dry_shard(job: JobConfig, model: nn.Module) -> list[tuple[str, str]]:
    """``validate``: shard ``model`` as a rank of a stage would, without processes (heads
    not divisible, nothing to shard...: a ConfigError before a launch); what was sharded."""
    from ...comm.tp.comm import TPComm
    from ...tensor_parallel import TensorParallelModule

    cfg = job.tensor_parallel
    assert cfg is not None
    tp = cfg.tensor_parallel_size
    comm = TPComm(None, list(range(tp)), rank=0, pattern=cfg.communication_pattern.value)
    try:
        return list(TensorParallelModule(model, cfg, TPGroups(comm, None, tp, 1, 0)).layout())
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError([("tensor_parallel", str(e))]) from None


class TPPipelineEngine(PipelineEngine):
    """A pipeline stage's engine whose stage is tensor-parallel over ``groups.tp``."""

    def __init__(self, *args: Any, groups: TPGroups, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.tp = groups.tp_size
        from ...tensor_parallel.shards import shard_spec

        self._shards: dict[str, Any] = {
            k: spec for k, t in self.stage.state_dict(keep_vars=True).items()
            if isinstance(t, nn.Parameter) and (spec := shard_spec(t, groups.tp.rank)) is not None}

    def grad_sq_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for t, p in self.norm_pieces():  # a TP-replicated tensor counts once over its TP group
            total += local_grad_sq_norm([t]) / replicas_of(p, self.tp)
        C.all_reduce_(total, group=self.ctx.group)
        return float(total)

    def stage_shards(self) -> dict[str, Any]:
        return dict(self._shards)


def dense_own(stage: StageModel, own: dict[str, torch.Tensor], groups: TPGroups) -> dict[str, torch.Tensor]:
    """``own`` (:meth:`StageModel.node_state`) with every TP shard all-gathered over the
    stage's TP group (in name order, the same on every rank of the row) into its dense
    tensor, a packed projection's parts concatenated under its dense name."""
    shards: dict[str, nn.Parameter] = {}
    for i, m in stage.segments.items():
        part = stage._parts.get(int(i))
        for k, v in m.state_dict(keep_vars=True).items():
            if getattr(v, "tp_shard_dim", None) is not None:
                shards.setdefault(part.original_name(k) if part is not None else k, v)
    out = dict(own)
    with torch.no_grad():
        for name in sorted(shards):
            p = shards[name]
            out[name] = groups.tp.all_gather(p.detach(), int(p.tp_shard_dim),  # type: ignore[attr-defined]
                                             list(p.tp_sizes)).wait()  # type: ignore[attr-defined]
    # a packed projection's parts (GPT-2's c_attn.q/.k/.v) back into its one dense tensor
    from ...tensor_parallel.shards import pack_dense, packed_dims

    for i, m in stage.segments.items():
        part = stage._parts.get(int(i))
        named = part.original_name if part is not None else str
        parts = {k: out.pop(named(k)) for k in packed_dims(m) if named(k) in out}
        out.update({named(k): v for k, v in pack_dense(m, parts).items()})
    return out
