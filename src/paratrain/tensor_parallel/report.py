"""What a tensor-parallel model reports about itself (a mixin of
:class:`~.module.TensorParallelModule`): ``layout``, what tensor parallelism did to each module
(``paratrain validate`` / ``graph`` print it), and ``statistics``, the counters of
:class:`~paratrain.comm.stats.CommStats` plus this rank's parameter memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from paratrain.comm.stats import CommStats

from .grid import GridLinear, grid_steps
from .layers import (
    ColumnParallelLinear,
    ParallelEncoderLayer,
    ParallelSelfAttention,
    RowParallelLinear,
)
from .partition import TensorParallelism


def param_bytes(params: Iterator[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def describe_layer(m: nn.Module) -> str | None:
    """One line for one of paratrain's parallel layers (None for anything else)."""
    if isinstance(m, ParallelSelfAttention):
        return f"attention heads split ({m.local_heads} per rank): q/k/v colwise, o rowwise"
    if isinstance(m, ParallelEncoderLayer):
        return "encoder layer: attention heads split, linear1 colwise, linear2 rowwise"
    if isinstance(m, GridLinear):
        return "2-D grid block (BlockWise)"
    if isinstance(m, ColumnParallelLinear):
        return "colwise" + (", output gathered" if m.gather_output else "") + (
            ", sequence parallel" if m.mode == "seq" else "")
    if isinstance(m, RowParallelLinear):
        return "rowwise" + ("" if m.input_is_parallel else ", input split here") + (
            ", sequence parallel" if m.mode == "seq" else "")
    return None


class ModuleReport:
    """The layout and statistics of a converted model."""

    module: nn.Module
    comm: Any
    stats: CommStats
    pattern: str
    batch_split: bool
    sharding: list[tuple[str, str]]
    coordinator: TensorParallelism
    dense_param_bytes: int
    last_peak_activation_bytes: int | None

    def layout(self) -> list[tuple[str, str]]:
        """What tensor parallelism did to each module it touched, as ``(path, how)`` in model
        order: the plan's and the block rules' notes, then paratrain's own parallel layers
        (``paratrain validate`` / ``graph`` print it)."""
        if self.batch_split:
            return [("<root>", "BatchWise: the whole model on each rank's slice of the batch")]
        out = list(self.sharding)
        noted = [p for p, _ in out]
        for path, m in self.module.named_modules():
            if any(path == n or path.startswith(n + ".") for n in noted):
                continue
            how = describe_layer(m)
            if how is not None:
                out.append((path or "<root>", how))
                noted.append(path)
        return out

    def statistics(self) -> dict[str, Any]:
        """The run's communication counters and this rank's parameter memory."""
        snap = self.stats.snapshot()
        params = list(self.module.parameters())
        local = param_bytes(iter(params))
        sharded = param_bytes(p for p in params if hasattr(p, "tp_shard_dim") or grid_steps(p))
        replicated = local - sharded
        dense_sharded = self.dense_param_bytes - replicated
        tp = self.comm.size
        snap.update({
            "tensor_parallel_size": tp,
            "communication_pattern": self.pattern,
            "param_bytes_local": local,
            "param_bytes_dense": self.dense_param_bytes,
            "param_bytes_replicated": replicated,
            "param_memory_fraction": local / self.dense_param_bytes if self.dense_param_bytes else 1.0,
            "param_memory_ideal_fraction": ((dense_sharded / tp + replicated) / self.dense_param_bytes
                                            if self.dense_param_bytes else 1.0),
            "memory_saving": 1 - local / self.dense_param_bytes if self.dense_param_bytes else 0.0,
            "total_partitions": self.coordinator.total_partitions,
            "local_partitions": self.coordinator.local_partitions,
            "peak_activation_bytes": self.last_peak_activation_bytes,
            # the Rust TensorParallelismStatistics names, with real values
            "communication_volume": snap["bytes_sent_modelled"],  # ring model, see CommStats
            "communication_time": snap["communication_time_s"],
            "computation_time": snap["computation_time_s"],
            "efficiency_score": (snap["computation_time_s"]
                                 / (snap["computation_time_s"] + snap["communication_time_s"])
                                 if snap["computation_time_s"] + snap["communication_time_s"] > 0
                                 else 0.0),
            "memory_usage_per_device": {self.comm.global_rank: local},
        })
        if self.pattern == "Hierarchical":
            # the two-level layout the topology gave, e.g. "flat (1 host)" (comm/groups.py)
            snap["hierarchy"] = getattr(self.comm, "hierarchy", None) or "flat (1 rank)"
        return snap
