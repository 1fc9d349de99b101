"""Partition arithmetic (rust-behaviour.md §3.5-3.6 vectors), validation, properties,
and single-process behaviour of the tensor-parallel layers."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.tensor_parallel import (
    TensorParallelism,
    TensorPartition,
    parallelize,
    partition_shape,
    register_custom_partitioner,
    split_sizes,
)
from paratrain.tensor_parallel import partition as partition_mod


def parts(shape: tuple[int, ...], strategy: str, tp: int = 2, world: int | None = None) -> list[tuple]:
    return [(p.shape, p.offset) for p in
            partition_shape("t", shape, strategy, tp=tp, world_size=world or tp)]


# -- reference vectors ------------------------------------------------------------------------


def test_reference_vectors_world2() -> None:
    assert parts((100, 200), "ColumnWise") == [((100, 100), (0, 0)), ((100, 100), (0, 100))]
    assert parts((100, 200), "RowWise") == [((50, 200), (0, 0)), ((50, 200), (50, 0))]
    assert parts((64, 100, 200), "BatchWise") == [((32, 100, 200), (0, 0, 0)),
                                                   ((32, 100, 200), (32, 0, 0))]


def test_trailing_empty_chunks_are_dropped() -> None:
    got = partition_shape("w", (3, 5), "ColumnWise", tp=4, world_size=4)
    assert [(p.partition_id, p.shape, p.offset) for p in got] == [
        (0, (3, 2), (0, 0)), (1, (3, 2), (0, 2)), (2, (3, 1), (0, 4))]
    assert partition_shape("z", (4, 0), "ColumnWise", tp=2, world_size=2) == []


def test_blockwise_vector_and_fallback() -> None:
    assert parts((5, 5), "BlockWise", tp=4) == [
        ((3, 3), (0, 0)), ((3, 2), (0, 3)), ((2, 3), (3, 0)), ((2, 2), (3, 3))]
    # tp not a perfect square: ColumnWise
    assert parts((4, 6), "BlockWise", tp=2) == parts((4, 6), "ColumnWise", tp=2)
    # the 2-D check comes before the fallback
    with pytest.raises(ValueError, match="Block-wise partitioning only supports 2D tensors"):
        partition_shape("t", (2, 3, 4), "BlockWise", tp=2, world_size=2)


def test_blockwise_ids_count_emitted_blocks_only() -> None:
    got = partition_shape("t", (1, 5), "BlockWise", tp=4, world_size=4)
    # the second block-row starts at row 1 = rows -> skipped
    assert [(p.partition_id, p.shape, p.offset) for p in got] == [(0, (1, 3), (0, 0)),
                                                                   (1, (1, 2), (0, 3))]


def test_sequence_and_dynamic() -> None:
    assert parts((4, 6, 8), "SequenceWise") == [((4, 3, 8), (0, 0, 0)), ((4, 3, 8), (0, 3, 0))]
    assert parts((10, 20), "Dynamic") == parts((10, 20), "ColumnWise")
    assert parts((20, 10), "Dynamic") == parts((20, 10), "RowWise")
    assert parts((10, 10), "Dynamic") == parts((10, 10), "RowWise")  # ties go to RowWise
    assert parts((8,), "Dynamic") == parts((8,), "BatchWise")


def test_needs_communication_only_false_for_batchwise() -> None:
    for s in ["ColumnWise", "RowWise", "SequenceWise", "BlockWise"]:
        assert all(p.needs_communication for p in
                   partition_shape("t", (4, 4), s, tp=2, world_size=2))
    assert not any(p.needs_communication for p in
                   partition_shape("t", (4, 4), "BatchWise", tp=2, world_size=2))


@pytest.mark.parametrize("strategy,shape,msg", [
    ("ColumnWise", (5,), "Column-wise partitioning requires at least 2D tensor"),
    ("RowWise", (5,), "Row-wise partitioning requires at least 2D tensor"),
    ("BatchWise", (), "Batch-wise partitioning requires at least 1D tensor"),
    ("SequenceWise", (5,), "Sequence-wise partitioning requires at least 2D tensor"),
])
def test_rank_too_low(strategy: str, shape: tuple[int, ...], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        partition_shape("t", shape, strategy, tp=2, world_size=2)


@pytest.mark.parametrize("tp,world,msg", [
    (0, 2, "at least 1"),
    (4, 2, r"Tensor parallel size \(4\) cannot exceed world size \(2\)"),
    (3, 4, r"World size \(4\) must be divisible by tensor parallel size \(3\)"),
])
def test_world_validation(tp: int, world: int, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as e:
        partition_shape("t", (4, 4), "ColumnWise", tp=tp, world_size=world)
    assert e.value.problems[0][0] == "tensor_parallel.tensor_parallel_size"


def test_config_rejects_zero_tp() -> None:
    with pytest.raises(Exception, match="greater than or equal to 1"):
        TensorParallelismConfig(tensor_parallel_size=0)


@pytest.fixture
def custom_registry() -> Iterator[None]:
    saved = list(partition_mod._CUSTOM)
    partition_mod._CUSTOM.clear()
    yield
    partition_mod._CUSTOM[:] = saved


def test_custom_strategy_needs_and_uses_registered_function(custom_registry: None) -> None:
    with pytest.raises(ValueError, match="register_custom_partitioner"):
        partition_shape("t", (4, 4), "Custom", tp=2, world_size=2)

    @register_custom_partitioner
    def first_row_everything(name: str, shape: tuple[int, ...], tp: int, world: int) -> list[TensorPartition]:
        return [TensorPartition(0, 0, name, shape, (0,) * len(shape), False)]

    got = partition_shape("t", (4, 4), "Custom", tp=2, world_size=2)
    assert got == [TensorPartition(0, 0, "t", (4, 4), (0, 0), False)]


def test_coordinator_records_and_replaces() -> None:
    cfg = TensorParallelismConfig(tensor_parallel_size=2, partitioning_strategy="RowWise")
    c = TensorParallelism(cfg, global_rank=1, world_size=4)
    assert [p.shape for p in c.partition_tensor("w", (8, 3))] == [(4, 3), (4, 3)]
    assert c.get_local_partitions("w") == [1]
    c.partition_tensor("w", (3, 8), "ColumnWise")  # replaces the earlier entry
    c.partition_tensor("b", (2, 6))
    assert c.total_partitions == 4 and c.local_partitions == 2
    assert c.get_tensor_partitions("missing") is None
    with pytest.raises(ConfigError, match="cannot exceed"):
        TensorParallelism(TensorParallelismConfig(tensor_parallel_size=8), 0, 4)


# -- properties --------------------------------------------------------------------------------


@given(n=st.integers(0, 200), p=st.integers(1, 16))
def test_split_sizes_properties(n: int, p: int) -> None:
    s = split_sizes(n, p)
    assert len(s) == p and sum(s) == n
    assert s == sorted(s, reverse=True)
    assert max(s) == (-(-n // p) if n else 0)


@given(shape=st.lists(st.integers(0, 40), min_size=2, max_size=4),
       tp_world=st.sampled_from([(1, 1), (2, 2), (2, 4), (3, 3), (4, 4), (4, 8), (8, 8)]),
       strategy=st.sampled_from(["ColumnWise", "RowWise", "BatchWise", "SequenceWise", "Dynamic"]))
def test_axis_partitions_tile_the_tensor(shape: list[int], tp_world: tuple[int, int], strategy: str) -> None:
    tp, world = tp_world
    got = partition_shape("t", shape, strategy, tp=tp, world_size=world)
    total = sum(math.prod(p.shape) for p in got)
    assert total == math.prod(shape)
    assert [p.partition_id for p in got] == list(range(len(got)))
    assert all(p.device_rank == p.partition_id % world for p in got)
    assert len(got) <= tp
    # offsets are contiguous along exactly one axis
    if got:
        axes = {i for p in got for i, o in enumerate(p.offset) if o}
        assert len(axes) <= 1


@given(rows=st.integers(1, 30), cols=st.integers(1, 30), g=st.sampled_from([1, 2, 3, 4]))
def test_blockwise_tiles_the_matrix(rows: int, cols: int, g: int) -> None:
    got = partition_shape("t", (rows, cols), "BlockWise", tp=g * g, world_size=g * g)
    cover = torch.zeros(rows, cols, dtype=torch.int32)
    for p in got:
        cover[p.slices] += 1
    assert bool((cover == 1).all())


# -- single-process behaviour ------------------------------------------------------------------


def test_tp1_is_the_dense_model_and_stats_are_zero() -> None:
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    tpm = parallelize(copy.deepcopy(dense), TensorParallelismConfig())
    x = torch.randn(5, 4)
    assert torch.equal(tpm(x), dense(x))
    s = tpm.statistics()
    assert s["total_collectives"] == 0 and s["memory_saving"] == 0.0


def test_tp_greater_than_world_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        parallelize(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
                    TensorParallelismConfig(tensor_parallel_size=2))


def test_rust_utils() -> None:
    from paratrain.tensor_parallel import (
        calculate_memory_savings,
        calculate_optimal_tensor_config,
        estimate_communication_overhead,
    )

    # 10 B params in 8 GiB per device on 8 ranks: Rust says tp = 5 (does not divide 8)
    assert calculate_optimal_tensor_config(10**10, 8 * 2**30, 8).tensor_parallel_size == 8
    assert calculate_optimal_tensor_config(1000, 10**9, 8).tensor_parallel_size == 1
    with pytest.raises(ValueError):
        calculate_optimal_tensor_config(10, 0, 2)
    cfg = TensorParallelismConfig(tensor_parallel_size=4)
    assert estimate_communication_overhead(cfg, 2**20, 3) == 6.0
    ag = TensorParallelismConfig(tensor_parallel_size=4, communication_pattern="AllGather")
    assert estimate_communication_overhead(ag, 2**20, 1) == 4.0
    p2p = TensorParallelismConfig(tensor_parallel_size=4, communication_pattern="PointToPoint")
    assert estimate_communication_overhead(p2p, 2**20, 1) == 1.0
    assert calculate_memory_savings(1000, 4) == 0.75
    assert calculate_memory_savings(10, 3) == pytest.approx(0.7)
    assert calculate_memory_savings(0, 2) == 0.0 and calculate_memory_savings(100, 1) == 0.0


@given(st.integers(1, 4), st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_grid_blocks_tile_every_weight_and_match_partition_tensor(g: int, out_f: int, in_f: int,
                                                                 bias: bool) -> None:
    """On a g x g grid (built without a process group, as the dry run does), the blocks
    GridLinear keeps at every position tile the dense weight and bias exactly once, and
    each weight block is the one ``partition_tensor`` assigns to that rank (BlockWise on
    the [in, out] shape: in-blocks by grid row, out-blocks by grid column) when no block
    is empty."""
    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import build_grid
    from paratrain.tensor_parallel import GridLinear, RegionState

    torch.manual_seed(0)
    dense = nn.Linear(in_f, out_f, bias=bias)
    cover = torch.zeros(out_f, in_f, dtype=torch.int64)
    bias_cover = torch.zeros(out_f, dtype=torch.int64)
    # partition_tensor drops empty trailing blocks (and renumbers): compare when none is empty
    no_empty = all(split_sizes(in_f, g)) and all(split_sizes(out_f, g))
    parts_ = {q.device_rank: q for q in partition_shape("w", (in_f, out_f), "BlockWise",
                                                       tp=g * g, world_size=g * g)} if g > 1 and no_empty else {}
    for t in range(g * g):
        grid = build_grid(TPComm(None, list(range(g * g)), rank=t))
        assert (grid.i, grid.j) == divmod(t, g)
        m = GridLinear.from_dense(dense, grid=grid, state=RegionState())
        o0, i0 = sum(m.out_sizes[:grid.j]), sum(m.in_sizes[:grid.i])
        h, w = m.weight.shape
        assert torch.equal(m.weight, dense.weight[o0:o0 + h, i0:i0 + w])
        cover[o0:o0 + h, i0:i0 + w] += 1
        if bias:
            assert m.bias is not None and dense.bias is not None
            assert torch.equal(m.bias, dense.bias[o0:o0 + h])
            if grid.i == 0:
                bias_cover[o0:o0 + h] += 1
        if t in parts_:  # partition_tensor's BlockWise block of [in, out] for this rank
            q = parts_[t]
            assert (q.offset, q.shape) == ((i0, o0), (w, h))
    assert bool((cover == 1).all())
    assert not bias or bool((bias_cover == 1).all())
