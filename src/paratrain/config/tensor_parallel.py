"""TensorParallelismConfig with its three enums and the Rust ``Default`` values.

Missing keys take the defaults (the Rust form requires all keys; lenient on purpose).
The enums serialise as plain strings, e.g. ``"ColumnWise"``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from ._base import Contract, Count, PositiveCount, load_document

__all__ = [
    "TensorPartitioningStrategy", "TensorCommunicationPattern", "TensorMemoryOptimization",
    "TensorParallelismConfig", "load_tensor_parallel", "dump_tensor_parallel",
]


class TensorPartitioningStrategy(StrEnum):
    ColumnWise = "ColumnWise"
    RowWise = "RowWise"
    BatchWise = "BatchWise"
    SequenceWise = "SequenceWise"
    Dynamic = "Dynamic"
    BlockWise = "BlockWise"
    Custom = "Custom"


class TensorCommunicationPattern(StrEnum):
    AllReduce = "AllReduce"
    AllGather = "AllGather"
    ReduceScatter = "ReduceScatter"
    PointToPoint = "PointToPoint"
    Hierarchical = "Hierarchical"


class TensorMemoryOptimization(StrEnum):
    None_ = "None"
    Low = "Low"
    Medium = "Medium"
    High = "High"
    Extreme = "Extreme"


class TensorParallelismConfig(Contract):
    tensor_parallel_size: PositiveCount = 1
    """Ranks per tensor-parallel group (divides the process count; the rest is data parallelism); 1
    = off."""
    partitioning_strategy: TensorPartitioningStrategy = TensorPartitioningStrategy.ColumnWise
    """How layer pairs are split: ColumnWise, RowWise, BatchWise, SequenceWise, Dynamic, Custom, or
    BlockWise (with a square size, a 2-D grid of every weight)."""
    column_parallel: bool = True
    """Create column-parallel Linear layers (with row_parallel: column/row pairs)."""
    row_parallel: bool = True
    """Create row-parallel Linear layers (with column_parallel: column/row pairs)."""
    communication_pattern: TensorCommunicationPattern = TensorCommunicationPattern.AllReduce
    """The collective that carries the tensor-parallel reductions (ReduceScatter: the
    sequence-parallel layout)."""
    async_communication: bool = True
    """Overlap the column layer's input-gradient collective with the weight-gradient matmul;
    gradient buckets all in flight at once."""
    fusion_threshold_bytes: Count = 1048576
    """q/k/v share one input-gradient collective, and small gradient reductions are packed into flat
    buffers, up to this size; 0 = no fusion."""
    gradient_accumulation: bool = True
    """Synchronise gradients once per step over micro_batches (false = once per micro-batch)."""
    memory_optimization: TensorMemoryOptimization = TensorMemoryOptimization.Medium
    """Activation checkpointing: None, Low/Medium/High (every 4/2/1 blocks); Extreme also offloads
    saved tensors to host memory."""
    mixed_precision: bool = False
    """bf16 matmuls with fp32 master weights, gradients and reductions."""
    micro_batches: PositiveCount = 1
    """Extension (dumped only when set): micro-batches per optimizer step, the unit
    gradient_accumulation accumulates over."""

    _extensions: ClassVar[frozenset[str]] = frozenset({"micro_batches"})


def load_tensor_parallel(doc: str | bytes | dict[str, Any] | TensorParallelismConfig) -> TensorParallelismConfig:
    """Validate a TensorParallelismConfig from JSON text or a dict; raises ConfigError."""
    if isinstance(doc, TensorParallelismConfig):
        return doc
    return load_document(TensorParallelismConfig.model_validate, doc)


def dump_tensor_parallel(config: TensorParallelismConfig) -> dict[str, Any]:
    """All ten keys (the Rust form requires every one)."""
    return config.model_dump(mode="json")
