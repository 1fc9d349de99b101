"""Tensor parallelism: partition arithmetic, column/row parallel layers, ``parallelize``.

See DESIGN §4 and Shoeybi et al. 2019 (Megatron-LM). All collectives live in
:mod:`paratrain.comm.tp` (the autograd operators that call them in :mod:`.autograd`);
``parallelize`` (:mod:`.parallelize`) converts a model with the rules of :mod:`.rules` and
:mod:`.attention_spec`, walked by :mod:`.converter`, into a :mod:`.module`
``TensorParallelModule``. What each TensorParallelismConfig field does:

- ``tensor_parallel_size``: ranks per TP group (must divide the world; the rest is DP).
- ``partitioning_strategy``: how pairs are split (``partition_tensor`` arithmetic; see
  :mod:`.parallelize`): column-first, row-first, batch split, sequence split, custom sizes,
  and for BlockWise with ``tp = g^2`` a 2-D grid of every weight (:mod:`.grid`).
- ``column_parallel`` / ``row_parallel``: which Linear kinds are created (both = pairs).
- ``communication_pattern``: the collective that carries the TP reductions (and the
  sequence-parallel layout for ReduceScatter).
- ``async_communication``: the column layer's input-gradient collective is started
  asynchronously and overlapped with the weight-gradient matmul; gradient buckets are
  all in flight at once.
- ``fusion_threshold_bytes``: q/k/v share one input-gradient collective and small
  gradient reductions are packed into flat buffers up to this size.
- ``gradient_accumulation``: sync once per step over ``micro_batches`` (else per
  micro-batch).
- ``memory_optimization``: activation checkpointing every 4/2/1 blocks, Extreme also
  offloads saved tensors to host memory; the recomputation reads the forward collectives'
  outputs back from a tape, so no level communicates more than None (:mod:`.memory`).
- ``mixed_precision``: bf16 matmuls, fp32 master weights, gradients and reductions.
"""

from .attention_spec import AttentionSpec, is_attention
from .grid import GridLinear
from .layers import (
    ColumnParallelLinear,
    ParallelSelfAttention,
    RegionState,
    RowParallelLinear,
    SelfAttention,
)
from .memory import ActivationMeter
from .module import TensorParallelModule
from .parallelize import parallelize
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

__all__ = [
    "ActivationMeter",
    "AttentionSpec",
    "ColumnParallelLinear",
    "GridLinear",
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
    "validate_world",
]
