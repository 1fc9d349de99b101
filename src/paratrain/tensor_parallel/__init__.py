"""Tensor parallelism (DESIGN §4; Shoeybi et al. 2019, Megatron-LM): column/row-parallel
layers (:mod:`.layers`, :mod:`.autograd`) and ``parallelize`` (:mod:`.module`), which converts
a model by the rules of :mod:`.rules`, :mod:`.foreign` (HF, timm) and :mod:`.plan`.

Why these layers and not torch's DTensor + ``parallelize_module``: on 2 gloo CPU ranks
(``benchmarks/tensor_parallel.py``, RESULTS.md) a training step takes 0.57x (4-layer MLP) and
0.79x (transformer block) of torch's documented default's time, with 4 collectives per block
step to its 6, at the default ``memory_optimization`` (whose recomputation reads the forward
collectives back from a tape, :mod:`.memory`, which DTensor cannot); and a few things DTensor
does not give: modules written by others (HF, timm) sharded only where their forward provably
survives, per-rank Custom sizes, the 2-D BlockWise grid, BatchWise, every collective counted
through ``TPComm`` (its PointToPoint / Hierarchical patterns), and checkpoints keyed by the dense
model's names with shard specs (resume on another size, bit for bit on the same one). The same
weights give torch's ColwiseParallel / RowwiseParallel outputs and gradients (within 1e-5):
``tests/tensor_parallel/test_tensor_parallel_dist.py::test_parity_with_torch_tensor_parallel_styles``.
"""

from .grid import GridLinear
from .layers import (
    ColumnParallelLinear,
    ParallelSelfAttention,
    RegionState,
    RowParallelLinear,
    SelfAttention,
)
from .memory import ActivationMeter
from .module import TensorParallelModule, parallelize
from .partition import (
    TensorParallelism,
    TensorPartition,
    calculate_memory_savings,
    calculate_optimal_tensor_config,
    estimate_communication_overhead,
    partition_shape,
    register_custom_partitioner,
    split_sizes,
)
from .rules import AttentionSpec

__all__ = [
    "ActivationMeter", "AttentionSpec", "ColumnParallelLinear", "GridLinear",
    "ParallelSelfAttention", "RegionState", "RowParallelLinear", "SelfAttention",
    "TensorParallelModule", "TensorParallelism", "TensorPartition", "calculate_memory_savings",
    "calculate_optimal_tensor_config", "estimate_communication_overhead", "parallelize",
    "partition_shape", "register_custom_partitioner", "split_sizes",
]
