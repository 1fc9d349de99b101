"""What the tensor-parallel executor ignores that only its model can tell (its spec's
``ignores``): ``memory_optimization`` levels and ``fusion_threshold_bytes``.

Both are judged on the job's model as rank 0 would shard it (:func:`probe_tp`, built here
without processes, through the job's Task): a ``memory_optimization`` level that
checkpoints the same segments as another level on this model (and ``Extreme`` without an
accelerator, whose offload does nothing) is reported; so is ``fusion_threshold_bytes`` when
the model has no attention (no q/k/v fusion) and the layout reduces no gradients over the TP
or DP group. The rules that need only the job are :mod:`paratrain.config.effective`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ...config.effective import Effective, Ignored, is_set
from ...config.job import JobConfig

__all__ = ["TPProbe", "probe_tp", "ignores"]

_LEVELS = ("None", "Low", "Medium", "High", "Extreme")


@dataclass(frozen=True)
class TPProbe:
    """The structure of a job's model once made tensor parallel (rank 0's view)."""

    blocks: int  # checkpoint units (a block starts at a tensor-parallel unit)
    attention: bool  # q/k/v projections whose input collective can be fused
    tp_grad_sync: bool  # replicated parameters whose gradients are summed over TP
    accelerator: bool  # saved-tensor offload (Extreme) has a device to free


def probe_tp(job: JobConfig) -> TPProbe | None:
    """Build the job's model through its Task (``[task]``, classification by default) and
    shard it as rank 0 would, without processes (the same construction as the
    tensor-parallel dry run). ``None`` when it cannot be built: that error is reported by
    preflight (``paratrain validate`` and ``run``), which makes the same construction."""
    try:
        import torch

        from ...comm.tp.comm import TPComm
        from ...comm.tp.groups import TPGroups
        from ...task import resolve_task
        from ...tensor_parallel import TensorParallelModule
        from ...tensor_parallel.layers import ParallelSelfAttention

        cfg = job.tensor_parallel
        assert cfg is not None
        tp = cfg.tensor_parallel_size
        task = resolve_task(job)  # the job's Task builds the model, as the run does
        train, _ = task.datasets(job.run.seed)
        model = task.build_model(job.model, train)
        comm = TPComm(None, list(range(tp)), rank=0, pattern=cfg.communication_pattern.value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tpm = TensorParallelModule(model, cfg, TPGroups(comm, None, tp, 1, 0))
        device = job.run.device
        accel = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        return TPProbe(
            blocks=len(tpm.blocks),
            attention=any(isinstance(m, ParallelSelfAttention) for m in tpm.modules()),
            tp_grad_sync=bool(tpm._sp_params),
            accelerator=accel,
        )
    except Exception:  # noqa: BLE001 - any failure here is reported by the real checks
        return None


def _memory_equivalents(level: str, probe: TPProbe) -> tuple[list[str], str]:
    """The other levels that run exactly as ``level`` on this model, and why."""
    from ...tensor_parallel.memory import SEGMENT_BLOCKS as seg
    from ...tensor_parallel.memory import SELECTIVE

    def effect(lv: str) -> tuple[int, bool, bool]:
        # segment length, host offload, selective (the sharded matmuls' outputs kept)
        k = seg[lv]
        return (min(k, probe.blocks) if k else 0, lv == "Extreme" and probe.accelerator, lv in SELECTIVE)

    same = [lv for lv in _LEVELS if lv != level and effect(lv) == effect(level)]
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
