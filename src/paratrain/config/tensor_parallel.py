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
    partitioning_strategy: TensorPartitioningStrategy = TensorPartitioningStrategy.ColumnWise
    column_parallel: bool = True
    row_parallel: bool = True
    communication_pattern: TensorCommunicationPattern = TensorCommunicationPattern.AllReduce
    async_communication: bool = True
    fusion_threshold_bytes: Count = 1048576
    gradient_accumulation: bool = True
    memory_optimization: TensorMemoryOptimization = TensorMemoryOptimization.Medium
    mixed_precision: bool = False
    # Extension (dumped only when set): micro-batches per optimizer step, the unit
    # ``gradient_accumulation`` accumulates over.
    micro_batches: PositiveCount = 1

    _extensions: ClassVar[frozenset[str]] = frozenset({"micro_batches"})


def load_tensor_parallel(doc: str | bytes | dict[str, Any] | TensorParallelismConfig) -> TensorParallelismConfig:
    """Validate a TensorParallelismConfig from JSON text or a dict; raises ConfigError."""
    if isinstance(doc, TensorParallelismConfig):
        return doc
    return load_document(TensorParallelismConfig.model_validate, doc)


def dump_tensor_parallel(config: TensorParallelismConfig) -> dict[str, Any]:
    """All ten keys (the Rust form requires every one)."""
    return config.model_dump(mode="json")
