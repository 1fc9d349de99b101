"""Pipeline x tensor parallelism: ModelParallel with ``[tensor_parallel]`` inside each stage,
and replicated stages on top of it (pp x dp x tp).

The job's ``W`` logical workers (its pipeline stages on ``worker-0 .. worker-{P-1}``, plus the
extra workers its replicated stages take, ``[subgraphs.<path>] type = "DataParallel"``,
:mod:`.replicas`) times ``T = tensor_parallel_size`` run ``W x T`` processes laid out as the
mesh ``worker x tp`` (:class:`~paratrain.comm.mesh.Mesh`, ``rank = worker * T + tp``; named
``pp x tp`` when no stage is replicated). Every rank builds the same model and shards it
(:func:`paratrain.tensor_parallel.parallelize` over its mesh row, the worker's ``tp`` group);
the plan then cuts the *sharded* model (the parallel layers traced as leaves), so each rank
keeps its stage's TP shard.

The ranks with one ``tp`` index ``j`` form a *lane*: a whole pipeline whose stage ``s`` runs on
the physical ranks ``w*T + j`` for each logical worker ``w`` of that stage (one, or the stage's
replicas: :func:`lane_replicas`). A lane runs the unchanged pipeline runtime and schedule (1F1B,
GPipe, ...), its transfers going point-to-point between its own ranks (a replicated stage's
replicas each take their rows of every micro-batch, as without TP); all lanes run the same
order, so the TP collectives inside each stage pair up. Every schedule runs: GPipe, 1F1B,
Interleaved1F1B (a lane's rank holds its chunks' shards) and ZBH1 (``Direct`` too); under ZBH1
the W pass re-enters a tensor-parallel layer's backward, whose input-gradient all-reduce then
runs a second time (the same sum; all lanes repeat it in the same order). What crosses a cut
is what that rank holds: a replicated activation (each lane sends its copy) or, where a cut
falls between a column- and a row-parallel layer, the lane's shard of it. The loss, computed
on every lane's last stage, is the same on all of them; gradients are those of the
unpartitioned model (the TP layers' own collectives make them so).

A replicated stage's replicas that hold the same TP shard (one per replica, same ``j``: the
mesh's *dp* groups, :func:`replica_groups`) sum that shard's gradients after the step's last
backward (each replica's loss weighted by its rows), so every replica steps with the whole
batch's gradient of its shard: data parallelism over the shard, as in Megatron's dp x tp x pp.

Clipping by one global norm (:meth:`TPPipelineEngine.grad_sq_norm`): every rank of a stage's
first replica adds ``||g||^2 / f`` per parameter, ``f`` the TP ranks holding the same tensor
(1 for a shard, ``T`` for a replicated one), and one all-reduce over all ``W x T`` ranks sums
it.

Checkpoints: each TP shard is saved under the model's name with its place in the dense
tensor (:func:`paratrain.tensor_parallel.shards.shard_spec`; replicas' identical pieces are
written once); for the exported model each stage all-gathers its shards over its TP group into
the dense tensors first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ...comm.collectives import broadcast_module_
from ...comm.mesh import Mesh
from ...comm.tp.groups import TPGroups, build_tp_groups
from ...config import ConfigError
from ...config.job import JobConfig
from ...tensor_parallel.grid import replicas_of
from ...training.stepping import local_grad_sq_norm
from .engine import PipelineEngine, StageModel
from .replicas import Replicas

__all__ = ["tp_size_of", "lane_replicas", "replica_groups", "mesh_report", "shard_model", "TPPipelineEngine",
           "dense_own", "check_job", "dry_shard"]


def tp_size_of(job: JobConfig) -> int:
    tp = job.tensor_parallel
    return int(tp.tensor_parallel_size) if tp is not None else 1


def check_job(job: JobConfig) -> None:
    """What pipeline x TP does not run: DataStore."""
    if tp_size_of(job) <= 1:
        return
    proto = getattr(getattr(job.strategy, "communication", None), "protocol", None)
    if proto == "DataStore":
        raise ConfigError([("strategy.communication.protocol", (
            "DataStore passes activations through files between stages that need not be online "
            "together; tensor-parallel stages run collectives: use Pipeline or Direct"))])


def _extras(logical: Replicas) -> set[int]:
    return {w for g in logical.groups.values() for w in g[1:]}


def lane_replicas(logical: Replicas, workers: int, tp: int, rank: int) -> Replicas:
    """This rank's lane: stage ``s`` (a logical worker of the plan) runs on the physical ranks
    ``w*tp + (rank % tp)`` for each logical worker ``w`` of ``logical.of(s)`` (its replicas)."""
    j = rank % tp
    extra = _extras(logical)
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
    from ...tensor_parallel.foreign_layers import PackedColumnParallel
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
        self._shards: dict[str, Any] = {}
        from ...tensor_parallel.shards import shard_spec

        stage = self.stage
        for key, t in stage.state_dict(keep_vars=True).items():
            spec = shard_spec(t, groups.tp.rank) if isinstance(t, nn.Parameter) else None
            if spec is not None:
                self._shards[key] = spec

    def grad_sq_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for t, p in self.norm_pieces():  # a TP-replicated tensor counts once over its TP group
            total += local_grad_sq_norm([t]) / replicas_of(p, self.tp)
        from ...comm import collectives as C

        C.all_reduce_(total, group=self.ctx.group)
        return float(total)

    def stage_shards(self) -> dict[str, Any]:
        return dict(self._shards)

    def _to_rank0(self, payload: torch.Tensor | None) -> torch.Tensor | None:
        """As the base, within this rank's lane (its stage 0 and last stage)."""
        self._msgs += 1
        if self.last_rank == 0:
            return payload
        if self.rt.replica != 0:  # a stage's other replicas: its first one speaks for it
            return None
        prim = self.rt.replicas.of
        if self.ctx.rank == self.last_rank:
            assert payload is not None
            self.rt.send_metric(payload, dst=prim(0)[0], step=self._msgs, slot=1)
            return payload
        if self.ctx.rank == 0:
            return self.rt.recv_metric(src=prim(self.last_rank)[0], step=self._msgs, slot=1)
        return None


def dense_own(stage: StageModel, own: dict[str, torch.Tensor], groups: TPGroups) -> dict[str, torch.Tensor]:
    """This stage's tensors by name (``own``, :meth:`StageModel.node_state`) with every TP
    shard all-gathered over the stage's TP group (in name order: every rank of the row
    holds the same names) into the dense tensor, a packed projection's parts concatenated
    under its dense name."""
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
