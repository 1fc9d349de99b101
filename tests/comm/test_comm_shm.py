"""comm/shm.HostArena on gloo ranks of one host, against torch's ``dist.all_reduce``.

2 ranks: every bucket's sum equals gloo's bit for bit (fp32 of odd sizes, bf16), over several
rounds of fresh data with the buckets launched back to back (the barriers keep a fast rank
from writing its next round over what a slow one still reads). 3 ranks: every rank holds the
same sums, equal to gloo's to float rounding (summed in rank order, gloo in ring order).
``PARATRAIN_SHM=0`` (on every rank or on one) or a rank that cannot open the file (another
host) gives None on every rank, and GradReducer then uses gloo; no file is left in ``/dev/shm``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(120)

BUCKETS = [(1, torch.float32), (4097, torch.float32), (30_001, torch.float32), (513, torch.bfloat16)]


def _data(rank: int, rnd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rnd + 10 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def _reduce_rounds(arena: Any, rank: int, group: Any, n: int, between: Any = None) -> tuple[list[Any], list[Any]]:
    """``n`` rounds of fresh data through ``arena`` (every bucket launched, then ``between()``,
    then waited for), each sum beside gloo's ``dist.all_reduce`` of the same data."""
    got, want = [], []
    for rnd in range(n):
        works = []
        for b, (numel, dtype) in enumerate(BUCKETS):
            arena.slot(b).copy_(_data(rank, rnd, numel, dtype))
            works.append(arena.all_reduce(b))
        if between is not None:
            between()
        for w in works:
            w.wait()
        for b, (numel, dtype) in enumerate(BUCKETS):
            ref = _data(rank, rnd, numel, dtype)
            dist.all_reduce(ref, group=group)
            got.append(arena.slot(b).clone())
            want.append(ref)
    arena.close()
    return got, want


def rounds(ctx: WorkerContext) -> dict[str, Any]:
    from paratrain.comm.shm import HostArena

    arena = HostArena.create(BUCKETS, None)
    assert arena is not None
    got, want = _reduce_rounds(arena, ctx.rank, None, 4)
    return {"got": got, "want": want}


def test_two_ranks_equal_gloo_bit_for_bit_over_rounds() -> None:
    res = run_distributed(rounds, 2)
    for r in res:
        for g, w in zip(r["got"], r["want"], strict=True):
            assert torch.equal(g, w)
    # non-vacuity: the sums are not one rank's own data
    assert not torch.equal(res[0]["got"][2], _data(0, 0, 30_001, torch.float32))


def test_three_ranks_hold_the_same_sums_close_to_gloo() -> None:
    res = run_distributed(rounds, 3)
    for i, g in enumerate(res[0]["got"]):
        for r in res[1:]:
            assert torch.equal(r["got"][i], g)
        w = res[0]["want"][i]
        tol = 2e-2 if g.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def fallbacks(ctx: WorkerContext) -> dict[str, Any]:
    from paratrain.comm import shm
    from paratrain.comm.buckets import GradReducer

    made = shm.HostArena.create(BUCKETS, None)
    assert made is not None
    made.close()
    assert GradReducer(list(torch.nn.Linear(300, 300).parameters()))._arena is not None  # non-vacuity
    os.environ["PARATRAIN_SHM"] = "0"
    off = shm.HostArena.create(BUCKETS, None)
    layer = torch.nn.Linear(300, 300)  # a bucket over shm.MIN_BYTES: shared memory unless told no
    reducer = GradReducer(list(layer.parameters()))
    os.environ.pop("PARATRAIN_SHM")
    if ctx.rank == 1:  # one rank's environment says no: no rank maps the file, none waits
        os.environ["PARATRAIN_SHM"] = "0"
    one_off = shm.HostArena.create(BUCKETS, None)
    os.environ.pop("PARATRAIN_SHM", None)
    layer(torch.full((1, 300), float(ctx.rank + 1))).sum().backward()
    reducer.finish()
    reducer.remove()
    if ctx.rank == 1:  # as if rank 0's file were on another host
        def missing(path: str) -> int:
            raise FileNotFoundError(path)
        shm.open_existing = missing
    apart = shm.HostArena.create(BUCKETS, None)
    return {"off": off is None and one_off is None, "gloo": reducer._arena is None, "grad": layer.weight.grad.clone(),
            "apart": apart is None, "left": os.path.exists(made.path), "path": made.path}


def test_disabled_or_apart_every_rank_falls_back_to_gloo_and_nothing_is_left() -> None:
    res = run_distributed(fallbacks, 2)
    for r in res:
        assert r["off"] and r["gloo"] and r["apart"]
        assert r["path"].startswith("/dev/shm/paratrain-") and not r["left"]
        # the gloo path's mean of inputs 1 and 2
        torch.testing.assert_close(r["grad"], torch.full((300, 300), 1.5))


SHAPES = [(300, 400), (7,), (301, 3)]  # uneven rows: padding in the last ranks' shards


def _tensors(rank: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(*s, generator=g) for s in SHAPES[:2]] + [None]  # a None: zeros


def flat_shard(ctx: WorkerContext) -> dict[str, Any]:
    from paratrain.comm import shm
    from paratrain.comm.collectives import reduce_scatter
    from paratrain.comm.zero import FlatShard

    fs = FlatShard(SHAPES, world=ctx.world_size, rank=ctx.rank)
    mine = _tensors(ctx.rank)
    like = torch.empty(0)
    # gloo's reduce-scatter of the same packed buffer: the reference
    want = reduce_scatter(torch.empty(fs.numel), fs._pack_all(mine, like), average=True)
    got = fs.reduce_scatter(mine, torch.empty(fs.numel))
    # gather: every rank's rows of one set of whole tensors, back into whole tensors
    whole = [t if t is not None else torch.zeros(s) for t, s in zip(_tensors(0), SHAPES, strict=True)]
    outs = [torch.empty(s) for s in SHAPES]
    fs.gather(fs.pack_own(whole, torch.empty(fs.numel)), outs)
    arena = shm.sync_arena(None, 4 * fs.world * fs.numel)
    return {"got": got, "want": want, "gathered": all(torch.equal(a, b) for a, b in zip(outs, whole, strict=True)),
            "shared": arena is not None and 4 * fs.world * fs.numel > shm.MIN_BYTES}


@pytest.mark.parametrize("world", [2, 3])
def test_zero_flat_collectives_in_shared_memory_equal_gloo(world: int) -> None:
    res = run_distributed(flat_shard, world)
    for r in res:
        assert r["shared"] and r["gathered"]
        if world == 2:
            assert torch.equal(r["got"], r["want"])
        else:
            torch.testing.assert_close(r["got"], r["want"], rtol=1e-6, atol=1e-6)
    assert not torch.equal(res[0]["got"], res[1]["got"])  # non-vacuity: each rank its own rows


def subgroups(ctx: WorkerContext) -> dict[str, Any]:
    """A 2 x 2 mesh's columns {0, 2} and {1, 3}, each with an arena and a FlatShard, beside a
    side group of the same ranks (a checkpoint writer's, named by their hash) in use."""
    from paratrain.comm import shm
    from paratrain.comm.collectives import reduce_scatter, side_group
    from paratrain.comm.zero import FlatShard

    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = columns[ctx.rank % 2]
    side = side_group(mine)
    arena = shm.HostArena.create(BUCKETS, mine)
    assert arena is not None
    flag = torch.ones(1)
    # the side group's traffic while the arena's runs
    got, want = _reduce_rounds(arena, ctx.rank, mine, 3, lambda: dist.all_reduce(flag.fill_(1.0), group=side))
    fs = FlatShard(SHAPES, world=2, rank=dist.get_rank(mine))
    rows = _tensors(ctx.rank)
    ref_rs = reduce_scatter(torch.empty(fs.numel), fs._pack_all(rows, torch.empty(0)), average=True, group=mine)
    rs = fs.reduce_scatter(rows, torch.empty(fs.numel), group=mine)
    return {"got": got, "want": want, "side": float(flag), "rs": rs, "ref_rs": ref_rs,
            "sync": shm.sync_arena(mine, 4 * 2 * fs.numel) is not None}


def test_subgroups_sum_in_shared_memory_beside_a_side_group_of_the_same_ranks() -> None:
    res = run_distributed(subgroups, 4)
    for r in res:
        assert r["side"] == 2.0 and r["sync"]
        assert all(torch.equal(g, w) for g, w in zip(r["got"], r["want"], strict=True))
        assert torch.equal(r["rs"], r["ref_rs"])
    # non-vacuity: each column sums its own ranks' data
    assert not torch.equal(res[0]["got"][2], res[1]["got"][2])
    assert torch.equal(res[0]["got"][2], res[2]["got"][2])
