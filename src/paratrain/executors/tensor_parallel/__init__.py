"""Tensor parallelism (Megatron-style) as an executor: Local or DataParallel jobs with
``tensor_parallel_size > 1`` (DESIGN §6); the sharding itself is :mod:`paratrain.tensor_parallel`.
What it ignores that only the sharded model tells is :func:`ignores`' (the rules that need only
the job are :mod:`paratrain.config.effective`'s).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from ...config.effective import Effective, Ignored, is_set
from ...config.job import JobConfig
from ..shared.replicas import check_replica_rows
from ..spec import ExecutorSpec, GraphView, Traced
from .runner import dry_module, dry_run, mesh_lines, mesh_plan, run


@dataclass(frozen=True)
class TPProbe:
    """The structure of a job's model once made tensor parallel (rank 0's view)."""

    blocks: int  # checkpoint units (a block starts at a tensor-parallel unit)
    attention: bool  # q/k/v projections whose input collective can be fused
    tp_grad_sync: bool  # replicated parameters whose gradients are summed over TP
    accelerator: bool  # saved-tensor offload (Extreme) has a device to free


def probe_tp(job: JobConfig) -> TPProbe | None:
    """The job's model sharded as rank 0 would (the dry run's construction); ``None`` when
    that fails: preflight makes the same construction and reports the error."""
    try:
        import torch

        from ...tensor_parallel.layers import ParallelSelfAttention

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tpm = dry_module(job)
        device = job.run.device
        return TPProbe(
            blocks=len(tpm.blocks),
            attention=any(isinstance(m, ParallelSelfAttention) for m in tpm.modules()),
            tp_grad_sync=bool(tpm._sp_params),
            accelerator=device == "cuda" or (device == "auto" and torch.cuda.is_available()),
        )
    except Exception as e:  # noqa: BLE001 - any failure here is reported by the real checks
        logging.getLogger(__name__).info("tensor_parallel: the model could not be sharded to judge "
                                         "memory_optimization / fusion_threshold_bytes: %r", e)
        return None


def _memory_equivalents(level: str, probe: TPProbe) -> tuple[list[str], str]:
    """The other levels that run exactly as ``level`` on this model, and why."""
    from ...tensor_parallel.memory import SEGMENT_BLOCKS as seg
    from ...tensor_parallel.memory import SELECTIVE

    def effect(lv: str) -> tuple[int, bool, bool]:
        # segment length, host offload, selective (the sharded matmuls' outputs kept)
        k = seg[lv]
        return (min(k, probe.blocks) if k else 0, lv == "Extreme" and probe.accelerator, lv in SELECTIVE)

    same = [lv for lv in seg if lv != level and effect(lv) == effect(level)]
    k = seg[level]
    if k == 0:
        why = "no activation checkpointing"
    else:
        n = min(k, probe.blocks)
        why = (f"the model has {probe.blocks} checkpoint block(s), so {level} checkpoints "
               f"segments of {n} block(s)")
        if level == "Extreme" and not probe.accelerator:
            why += "; its host offload does nothing without an accelerator"
    return same, why


def ignores(job: JobConfig, *, resume: bool = False, probe: bool = True) -> Effective:
    """``memory_optimization`` / ``fusion_threshold_bytes`` set but without effect on this
    job's model; ``probe=False`` skips building the model (and reports neither)."""
    tp = job.tensor_parallel
    ignored: list[Ignored] = []
    if tp is None:
        return Effective(settings={})
    wants_mem = is_set(tp, "memory_optimization")
    wants_fuse = is_set(tp, "fusion_threshold_bytes") and tp.fusion_threshold_bytes > 0
    info = probe_tp(job) if probe and (wants_mem or wants_fuse) else None
    if info is not None and wants_mem:
        level = tp.memory_optimization.value
        same, why = _memory_equivalents(level, info)
        if same:
            ignored.append(Ignored(
                "tensor_parallel.memory_optimization",
                f"{level} has the same effect as {' / '.join(same)} on this model: {why}"))
    if info is not None and wants_fuse:
        strategy: Any = job.strategy
        dp = int(strategy.num_replicas) if strategy.type == "DataParallel" else 1
        # replicas' gradients are reduced over DP, unless a compressed exchange replaces it
        dp_coalesced = dp > 1 and job.compression is None
        if not (info.attention or info.tp_grad_sync or dp_coalesced):
            ignored.append(Ignored(
                "tensor_parallel.fusion_threshold_bytes",
                "nothing to fuse: the model has no attention q/k/v projections and this "
                "layout reduces no gradients over the tensor- or data-parallel group"))
    return Effective(settings={}, ignored=ignored)


def _processes(job: JobConfig) -> tuple[int, str]:
    """``tensor_parallel_size`` x DataParallel replicas (one for Local)."""
    strategy: Any = job.strategy
    tp = job.tensor_parallel.tensor_parallel_size if job.tensor_parallel else 1
    dp = int(strategy.num_replicas) if strategy.type == "DataParallel" else 1
    return tp * dp, "tensor_parallel.tensor_parallel_size"


def _describe(job: JobConfig) -> list[str]:
    """``paratrain validate``'s lines: which modules are sharded and how (the dry run), and a
    DataParallel job's dp x tp mesh (with ZeRO over its dp columns)."""
    lines = [f"tensor parallel: {p}: {how}" for p, how in dry_run(job)]
    if job.strategy.type == "DataParallel":
        lines += mesh_lines(job)
    return lines


def _graph(traced: Traced) -> GraphView:
    """``paratrain graph``'s sections: the modules sharded and how, the mesh (ZeRO's units)."""
    job = traced.job

    def sections() -> dict[str, Any]:
        tp: Any = job.tensor_parallel
        out: dict[str, Any] = {"tensor_parallel_size": tp.tensor_parallel_size,
                               "tensor_parallel": [{"module": p, "sharding": how} for p, how in dry_run(job)]}
        mesh = mesh_plan(job)  # the dp x tp mesh; ZeRO runs over its dp columns
        if "shard" in mesh:
            out["shard"] = mesh.pop("shard")
        out["mesh"] = mesh
        return out

    return GraphView(sections)


SPEC = ExecutorSpec(name="TensorParallel", run=run, processes=_processes, validate=dry_run,
                    check_data=check_replica_rows, ignores=ignores, describe=_describe, graph=_graph)
