"""Partition arithmetic for tensor parallelism (rust-behaviour.md §3.5-3.6, DESIGN §4), no
process group. A tensor of shape ``s`` is cut along dim ``d`` into ``tp`` ceil-sized chunks
(``per = ceil(s[d] / tp)``, chunk ``p`` covers ``[p*per, min((p+1)*per, s[d]))`` on rank ``p mod
world_size``; chunks past the end are dropped). ``d``: ColumnWise = last, RowWise =
second-to-last, BatchWise = 0 (no communication), SequenceWise = 1, Dynamic = ColumnWise when
the last dim is strictly larger than the second-to-last, else RowWise (BatchWise below 2-D);
BlockWise = a g x g grid when tp = g^2, else ColumnWise; Custom = the registered function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.config.tensor_parallel import TensorPartitioningStrategy


@dataclass(frozen=True)
class TensorPartition:
    """One chunk of a tensor: where it starts (``offset``), its ``shape``, its owner."""

    partition_id: int
    device_rank: int
    tensor_name: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    needs_communication: bool
    dependencies: tuple[int, ...] = field(default=())

    @property
    def slices(self) -> tuple[slice, ...]:
        """Index that cuts this partition out of the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))


# (name, shape, tp, world_size) -> partitions
CustomPartitioner = Callable[[str, tuple[int, ...], int, int], list[TensorPartition]]
_CUSTOM: list[CustomPartitioner] = []


def register_custom_partitioner(fn: CustomPartitioner) -> CustomPartitioner:
    """Register ``fn(name, shape, tp, world_size) -> partitions`` as the Custom strategy
    (a decorator; a later registration replaces an earlier one)."""
    _CUSTOM[:] = [fn]
    return fn


def validate_world(tp: int, world_size: int) -> None:
    """tp must be >= 1, at most the world, and divide it (rust-behaviour §3.5)."""
    if tp < 1:
        raise ConfigError([("tensor_parallel.tensor_parallel_size",
                            f"must be at least 1 (got {tp})")])
    if tp > world_size:
        raise ConfigError([("tensor_parallel.tensor_parallel_size",
                            f"Tensor parallel size ({tp}) cannot exceed world size ({world_size})")])
    if world_size % tp:
        raise ConfigError([("tensor_parallel.tensor_parallel_size",
                            f"World size ({world_size}) must be divisible by tensor parallel "
                            f"size ({tp})")])


def split_sizes(n: int, parts: int) -> list[int]:
    """Ceil-sized chunk lengths of ``n`` over ``parts`` slots, zeros at the end:
    ``split_sizes(5, 4) == [2, 2, 1, 0]``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1 (got {parts})")
    per = -(-n // parts) if n else 0
    return [max(0, min(per, n - p * per)) for p in range(parts)]


# strategy -> (the axis cut, counted from the end when negative; the dims it needs; its name)
_AXES = {
    TensorPartitioningStrategy.ColumnWise: (-1, 2, "Column-wise"),
    TensorPartitioningStrategy.RowWise: (-2, 2, "Row-wise"),
    TensorPartitioningStrategy.BatchWise: (0, 1, "Batch-wise"),
    TensorPartitioningStrategy.SequenceWise: (1, 2, "Sequence-wise"),
}


def _split_axis(name: str, shape: tuple[int, ...], axis: int, tp: int, world: int,
                comm: bool) -> list[TensorPartition]:
    out: list[TensorPartition] = []
    for pid, size in enumerate(split_sizes(shape[axis], tp)):
        if size == 0:
            continue
        start = pid * (-(-shape[axis] // tp))
        s = list(shape)
        s[axis] = size
        off = [0] * len(shape)
        off[axis] = start
        out.append(TensorPartition(pid, pid % world, name, tuple(s), tuple(off), comm))
    return out


def partition_shape(name: str, shape: Sequence[int], strategy: TensorPartitioningStrategy | str, *,
                    tp: int, world_size: int) -> list[TensorPartition]:
    """The partitions of a tensor of ``shape`` (pure function; see the module docstring)."""
    shape = tuple(int(x) for x in shape)
    if any(x < 0 for x in shape):
        raise ValueError(f"{name}: negative dimension in shape {shape}")
    validate_world(tp, world_size)
    strategy = TensorPartitioningStrategy(strategy)
    nd = len(shape)
    if strategy is TensorPartitioningStrategy.Custom:
        if not _CUSTOM:
            raise ValueError("partitioning_strategy Custom needs a function registered with "
                             "paratrain.tensor_parallel.register_custom_partitioner")
        return list(_CUSTOM[0](name, shape, tp, world_size))
    if strategy is TensorPartitioningStrategy.Dynamic:
        if nd >= 2:
            strategy = (TensorPartitioningStrategy.ColumnWise if shape[-1] > shape[-2]
                        else TensorPartitioningStrategy.RowWise)
        else:
            strategy = TensorPartitioningStrategy.BatchWise
    if strategy is TensorPartitioningStrategy.BlockWise:
        if nd != 2:
            raise ValueError(f"{name}: Block-wise partitioning only supports 2D tensors "
                             f"(got shape {shape})")
        g = math.isqrt(tp)
        if g * g != tp:
            strategy = TensorPartitioningStrategy.ColumnWise
        else:
            rows, cols = shape
            rpb, cpb = -(-rows // g), -(-cols // g)
            blocks: list[TensorPartition] = []
            for bi in range(g):
                for bj in range(g):
                    r0, c0 = bi * rpb, bj * cpb
                    if r0 >= rows or c0 >= cols:
                        continue
                    pid = len(blocks)
                    blocks.append(TensorPartition(
                        pid, pid % world_size, name,
                        (min(rpb, rows - r0), min(cpb, cols - c0)), (r0, c0), True))
            return blocks
    axis, need, what = _AXES[strategy]
    if nd < need:
        raise ValueError(f"{name}: {what} partitioning requires at least {need}D tensor (got shape {shape})")
    return _split_axis(name, shape, axis % nd, tp, world_size,
                       strategy is not TensorPartitioningStrategy.BatchWise)


class TensorParallelism:
    """The partition coordinator (rust-behaviour §3.4): validates the world, records the
    partitions of every tensor by name and which of them are local to ``global_rank``."""

    def __init__(self, config: TensorParallelismConfig, global_rank: int, world_size: int) -> None:
        validate_world(config.tensor_parallel_size, world_size)
        if not 0 <= global_rank < world_size:
            raise ValueError(f"global_rank {global_rank} outside world of size {world_size}")
        self.config = config
        self.global_rank = global_rank
        self.world_size = world_size
        self._partitions: dict[str, list[TensorPartition]] = {}
        self._local: dict[str, list[int]] = {}

    def partition_tensor(self, name: str, shape: Sequence[int],
                         strategy: TensorPartitioningStrategy | str | None = None) -> list[TensorPartition]:
        """Partition ``shape`` and record it under ``name`` (replacing earlier entries)."""
        parts = partition_shape(name, shape, strategy or self.config.partitioning_strategy,
                                tp=self.config.tensor_parallel_size, world_size=self.world_size)
        self._partitions[name] = parts
        self._local[name] = [i for i, p in enumerate(parts) if p.device_rank == self.global_rank]
        return parts

    def get_tensor_partitions(self, name: str) -> list[TensorPartition] | None:
        return self._partitions.get(name)

    def get_local_partitions(self, name: str) -> list[int] | None:
        return self._local.get(name)

    @property
    def total_partitions(self) -> int:
        return sum(len(p) for p in self._partitions.values())

    @property
    def local_partitions(self) -> int:
        return sum(len(p) for p in self._local.values())


def calculate_optimal_tensor_config(num_parameters: int, memory_per_device: int,
                                    world_size: int) -> TensorParallelismConfig:
    """The smallest tp that fits fp32 weights in ``memory_per_device`` bytes, capped at
    the world and rounded up to a divisor of it (rust-behaviour §3.10; the Rust version can
    return a tp that does not divide the world, and divides by zero for 0 bytes)."""
    if memory_per_device <= 0:
        raise ValueError(f"memory_per_device must be > 0 (got {memory_per_device})")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    tp = max(1, min(-(-num_parameters * 4 // memory_per_device), world_size))
    while world_size % tp:
        tp += 1
    return TensorParallelismConfig(tensor_parallel_size=tp)


def estimate_communication_overhead(config: TensorParallelismConfig, tensor_bytes: int,
                                    num_operations: int) -> float:
    """MiB moved by ``num_operations`` collectives of ``tensor_bytes`` (rust-behaviour §3.10):
    AllReduce 2x, AllGather tp x, the others 1x the tensor."""
    pattern = config.communication_pattern.value
    per_op = {"AllReduce": 2 * tensor_bytes,
              "AllGather": tensor_bytes * config.tensor_parallel_size}.get(pattern, tensor_bytes)
    return per_op * num_operations / 2**20


def calculate_memory_savings(num_parameters: int, tp: int) -> float:
    """Fraction of parameter memory saved per device, ``1 - (params // tp) / params``
    (0.0 for tp <= 1 or no parameters, where the Rust version returns NaN)."""
    if tp <= 1 or num_parameters <= 0:
        return 0.0
    return 1.0 - (num_parameters // tp) / num_parameters
