"""Tensor parallelism: partition arithmetic, column/row parallel layers, ``parallelize``.

See DESIGN §4 and Shoeybi et al. 2019 (Megatron-LM). All collectives live in
:mod:`paratrain.comm.tp_ops`.
"""

from .layers import (
    ColumnParallelLinear,
    ParallelSelfAttention,
    RegionState,
    RowParallelLinear,
    SelfAttention,
)
from .memory import ActivationMeter
from .parallelize import TensorParallelModule, is_attention, parallelize
from .partition import (
    TensorParallelism,
    TensorPartition,
    calculate_memory_savings,
    calculate_optimal_tensor_config,
    estimate_communication_overhead,
    partition_shape,
    register_custom_partitioner,
    split_sizes,
    validate_world,
)
from .train import train_step

__all__ = [
    "ActivationMeter",
    "ColumnParallelLinear",
    "ParallelSelfAttention",
    "RegionState",
    "RowParallelLinear",
    "SelfAttention",
    "TensorParallelModule",
    "TensorParallelism",
    "TensorPartition",
    "calculate_memory_savings",
    "calculate_optimal_tensor_config",
    "estimate_communication_overhead",
    "is_attention",
    "parallelize",
    "partition_shape",
    "register_custom_partitioner",
    "split_sizes",
    "train_step",
    "validate_world",
]
