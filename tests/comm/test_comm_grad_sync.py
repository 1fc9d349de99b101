"""comm/grad_sync.GradSync on 2 gloo ranks, the same rules in each of its modes.

Three linear layers: ``a`` used on both ranks, ``b`` on rank 1 only, ``c`` on neither. After
the sync, ``a`` and ``b`` hold the mean (``average=True``) or sum of the ranks' gradients
(rank 0 contributing zeros to ``b``) and ``c`` keeps ``grad = None``, whether the buckets
run after the backward (one bucket carries the gradients and the used flags: one
collective), overlap it (DDP's reducer) or go compressed (a TopK keeping every entry).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(120)


def _net() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({k: nn.Linear(4, 4) for k in "abc"})


def _backward(net: nn.ModuleDict, rank: int) -> None:
    x = torch.full((2, 4), float(rank + 1))
    out = net["a"](x)
    if rank == 1:
        out = out + net["b"](x)
    out.square().sum().backward()


def local_grads(rank: int) -> dict[str, torch.Tensor | None]:
    net = _net()
    _backward(net, rank)
    return {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}


def run_modes(ctx: WorkerContext) -> dict[str, Any]:
    from paratrain.comm.grad_sync import GradSync
    from paratrain.compression import Compressor
    from paratrain.config.compression import load_compression

    out: dict[str, Any] = {}
    modes = {"after": {}, "sum": {"average": False}, "overlap": {"overlap": True},
             "compressed": {"compressor": Compressor(load_compression({"method": "TopK", "k": 1 << 20}))}}
    for name, kw in modes.items():
        net = _net()
        sync = GradSync(list(net.named_parameters()), group=None, bucket_bytes=1 << 20, **kw)
        sync.before_forward(last=True)
        _backward(net, ctx.rank)
        issued = sync.sync()
        out[name] = {"issued": issued, "grads": {k: None if p.grad is None else p.grad.clone()
                                                 for k, p in net.named_parameters()}}
        sync.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run_modes, 2)


@pytest.mark.parametrize("mode", ["after", "sum", "overlap", "compressed"])
def test_used_parameters_combined_unused_left_none(results: list[dict[str, Any]], mode: str) -> None:
    mine = [local_grads(r) for r in range(2)]
    for r in results:
        got = r[mode]["grads"]
        for k, g in got.items():
            if k.startswith("c."):
                assert g is None, f"{mode}: {k} no rank used keeps no gradient"
                continue
            assert g is not None, f"{mode}: {k}"
            want = torch.zeros_like(g)
            for m in mine:
                got_r = m[k]
                if got_r is not None:
                    want += got_r
            want = want if mode == "sum" else want / 2
            torch.testing.assert_close(g, want, msg=f"{mode}: {k}")
    # non-vacuity: b really was used on one rank only
    assert mine[0]["b.weight"] is None and mine[1]["b.weight"] is not None


def test_after_the_backward_one_bucket_carries_gradients_and_flags(results: list[dict[str, Any]]) -> None:
    assert results[0]["after"]["issued"] == 1


def _branches(net: nn.ModuleDict, rank: int) -> None:
    """``a`` on both ranks, then ``c`` on rank 0 and ``b`` on rank 1: each rank's gradients
    become ready in a different bucket order (buckets of one tensor each)."""
    x = torch.full((2, 4), float(rank + 1))
    h = net["a"](x)
    (net["c"] if rank == 0 else net["b"])(h).square().sum().backward()


def branch_order(ctx: WorkerContext) -> dict[str, torch.Tensor | None]:
    from paratrain.comm.grad_sync import GradSync

    net = _net()
    sync = GradSync(list(net.named_parameters()), group=None, bucket_bytes=1, overlap=True)
    assert sync.reducer is not None and len(sync.reducer.buckets) == 6
    sync.before_forward(last=True)
    _branches(net, ctx.rank)
    sync.sync()
    sync.close()
    return {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}


def test_buckets_ready_in_a_different_order_on_each_rank_are_reduced_in_one_order() -> None:
    """DDP's rule: buckets go out in index order on every rank, whatever order they fill in,
    so ``b`` (rank 1's) and ``c`` (rank 0's) are never summed with each other (equal shapes,
    so a mismatched pairing would pass silently with wrong means)."""
    got = run_distributed(branch_order, 2)
    mine = []
    for rank in range(2):
        net = _net()
        _branches(net, rank)
        mine.append({k: p.grad for k, p in net.named_parameters()})
    for k in got[0]:
        parts = [m[k] for m in mine if m[k] is not None]
        want = sum(parts, torch.zeros_like(parts[0])) / 2
        for r in got:
            torch.testing.assert_close(r[k], want, msg=k)
    assert mine[0]["b.weight"] is None and mine[1]["c.weight"] is None  # non-vacuity
