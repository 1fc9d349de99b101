"""The autograd operators of tensor parallelism: Megatron-LM's conjugate region operators
(Shoeybi et al. 2019: f = identity forward / all-reduce backward before a column-parallel
layer, g its conjugate after a row-parallel one) and their sequence-parallel forms
(Korthikanti et al. 2022, §4.2.2: f an all-gather, g a reduce-scatter along the sequence dim).

``column_linear`` / ``row_linear`` are one Function each, so the backward collective of the
input gradient overlaps the weight-gradient matmul; :func:`fused_region` gives n consumers
of one input ONE backward collective of their summed gradients. Every forward collective goes
through :func:`.memory.taped`, so a recomputed segment reads its output back instead of
communicating again (a row layer's partial matmul runs inside the taped call and is skipped
too). Reductions run in fp32; only ``TPComm`` methods are called.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.autograd import Function

from paratrain.comm.tp.comm import Handle, TPComm

from .memory import keeps_matmuls, taped


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Reductions run in fp32: half-precision partial sums are upcast before they travel."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class _CopyToRegion(Function):
    """f: identity forward, sum-all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.comm.all_reduce(_fp32(g.contiguous())), None


def _own_slice(t: torch.Tensor, rank: int, dim: int, sizes: list[int]) -> torch.Tensor:
    return t.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


class _GatherScatter(Function):
    """``gather``: all-gather along ``dim`` forward, keep this rank's slice of the gradient
    backward (the consumer is replicated, so every rank holds the same full gradient); else
    the conjugate: keep the slice forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int],
                gather: bool) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.sizes, ctx.gather = comm, dim, sizes, gather
        if gather:
            return taped(lambda: comm.all_gather(x, dim, sizes).wait())
        return _own_slice(x, comm.rank, dim, sizes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if ctx.gather:
            g = _own_slice(g, ctx.comm.rank, ctx.dim, ctx.sizes)
        else:
            g = ctx.comm.all_gather(g.contiguous(), ctx.dim, ctx.sizes).wait()
        return g, None, None, None, None


class _Fused(Function):
    """n consumers of one input share one collective: f (identity forward; no ``sizes``) or
    the sequence all-gather along ``dim``; their partial input gradients are summed locally
    (in fp32) and reduced ONCE (all-reduce, or reduce-scatter) instead of n times."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, n: int, dim: int,
                sizes: list[int] | None) -> tuple[torch.Tensor, ...]:
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        full = x if sizes is None else taped(lambda: comm.all_gather(x.contiguous(), dim, sizes).wait())
        return tuple(full.view_as(full) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        gs = [g for g in grads if g is not None]
        total = _fp32(gs[0]).clone()
        for g in gs[1:]:
            total.add_(g)
        if ctx.sizes is None:
            return ctx.comm.all_reduce(total), None, None, None, None
        return ctx.comm.reduce_scatter(total, ctx.dim, ctx.sizes).wait(), None, None, None, None


def copy_to_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


def gather_from_region(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _GatherScatter.apply(x, comm, dim, sizes, True)


def scatter_to_region(x: torch.Tensor, comm: TPComm, dim: int, sizes: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _GatherScatter.apply(x, comm, dim, sizes, False)


def fused_region(x: torch.Tensor, comm: TPComm, n: int, dim: int = 0,
                 sizes: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """``x`` for ``n`` consumers through one f, or (``sizes``) one sequence all-gather."""
    if comm.size == 1:
        return tuple(x for _ in range(n))
    return tuple(_Fused.apply(x, comm, n, dim, sizes))


def _mm(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype | None) -> torch.Tensor:
    """``a @ b``; with a compute dtype the product runs in it and comes back as fp32, so
    every reduction and every saved gradient stays fp32 (mixed precision)."""
    if cdt is None:
        return a @ b
    return (a.to(cdt) @ b.to(cdt)).float()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., k] -> [N, k], also when k == 0 (a rank whose shard is empty)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _stash(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm,
           mode: str, dim: int, sizes: list[int] | None, cdt: torch.dtype | None) -> None:
    """What a sharded linear's backward needs: its input and weight, and how it ran."""
    ctx.save_for_backward(x, w)
    ctx.comm, ctx.mode, ctx.dim, ctx.sizes, ctx.cdt = comm, mode, dim, sizes, cdt
    ctx.has_bias = b is not None


def _wgrad(g: torch.Tensor, x: torch.Tensor, cdt: torch.dtype | None) -> torch.Tensor:
    return _mm(_rows(g).t(), _rows(x), cdt)


class _ColumnLinear(Function):
    """Y_i = f(X) W_i^T + b_i, W_i the rank's block of output rows. ``mode``: "copy" = Megatron
    f (dX = sum_i dY_i W_i all-reduced in backward, overlapped with dW_i = dY_i^T X when async);
    "seq" = X sequence-sharded, all-gathered forward, only the shard kept for backward
    (Korthikanti et al. 2022, §4.2.2) and re-gathered there while dX_i = dY_i W_i is computed,
    dX then reduce-scattered while dW_i is; "none" = the input's collective is done outside."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm,
                mode: str, dim: int, sizes: list[int] | None, cdt: torch.dtype | None) -> torch.Tensor:
        def product(xf: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            y = _mm(xf, w.t(), cdt)
            if b is not None:
                y = y + b
            comm.stats.add_compute_time(time.perf_counter() - t0)
            return y

        def gather() -> torch.Tensor:
            out: torch.Tensor = comm.all_gather(x.contiguous(), dim, sizes).wait()
            return out

        # selective recomputation keeps the product too (Korthikanti et al. 2022, §5); in
        # sequence-parallel mode it is kept instead of the gathered input, not besides it
        if mode != "seq":
            y = taped(lambda: product(x), matmul=True)
        elif keeps_matmuls():
            y = taped(lambda: product(gather()))
        else:
            y = product(taped(gather))
        _stash(ctx, x, w, b, comm, mode, dim, sizes, cdt)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        comm: TPComm = ctx.comm
        gy = gy.contiguous()
        seq = ctx.mode == "seq"
        gather: Handle | None = None
        if seq and ctx.needs_input_grad[1]:
            gather = comm.all_gather(x.contiguous(), ctx.dim, ctx.sizes, async_op=True)
        handle: Handle | None = None
        t0 = time.perf_counter()
        gx = _fp32(_mm(gy, w, ctx.cdt)) if ctx.needs_input_grad[0] else None
        t1 = time.perf_counter()
        if gather is not None:
            x = gather.wait()
        if gx is not None:
            if ctx.mode == "copy":
                handle = comm.all_reduce_async(gx)
            elif seq:
                handle = comm.reduce_scatter(gx, ctx.dim, ctx.sizes, async_op=True)
            else:
                handle = Handle(comm.stats, result=gx)
        t2 = time.perf_counter()
        gw = _wgrad(gy, x, ctx.cdt) if ctx.needs_input_grad[1] else None
        gb = _rows(gy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        t3 = time.perf_counter()
        gx_out = handle.wait() if handle is not None else None
        comm.stats.add_compute_time((t1 - t0) + (t3 - t2))
        return gx_out, gw, gb, None, None, None, None, None


class _RowLinear(Function):
    """Z = g(sum_i X_i W_i^T) + b, X_i the rank's slice of input features. ``mode``: "reduce"
    = Megatron g (all-reduce forward, identity back); "seq" = reduce-scatter along the sequence
    dim forward (bias added to the shard), all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm,
                mode: str, dim: int, sizes: list[int] | None, cdt: torch.dtype | None) -> torch.Tensor:
        def reduced() -> torch.Tensor:  # a replay skips the matmul along with the collective
            t0 = time.perf_counter()
            partial = _fp32(_mm(x, w.t(), cdt))
            comm.stats.add_compute_time(time.perf_counter() - t0)
            if mode == "seq":
                out: torch.Tensor = comm.reduce_scatter(partial, dim, sizes).wait()
                return out
            return comm.all_reduce(partial)

        z = taped(reduced)
        if b is not None:
            z = z + b
        _stash(ctx, x, w, b, comm, mode, dim, sizes, cdt)
        return z

    @staticmethod
    def backward(ctx: Any, gz: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        comm: TPComm = ctx.comm
        gz = gz.contiguous()
        gb = _rows(gz).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.mode == "seq":
            gz = comm.all_gather(gz, ctx.dim, ctx.sizes).wait()
        t0 = time.perf_counter()
        gx = _mm(gz, w, ctx.cdt) if ctx.needs_input_grad[0] else None
        gw = _wgrad(gz, x, ctx.cdt) if ctx.needs_input_grad[1] else None
        comm.stats.add_compute_time(time.perf_counter() - t0)
        return gx, gw, gb, None, None, None, None, None


def column_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm, *,
                  mode: str = "copy", dim: int = 0, sizes: list[int] | None = None,
                  compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    if comm.size == 1:
        mode = "none"
    return _ColumnLinear.apply(x, w, b, comm, mode, dim, sizes, compute_dtype)


def row_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, comm: TPComm, *,
               mode: str = "reduce", dim: int = 0, sizes: list[int] | None = None,
               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _RowLinear.apply(x, w, b, comm, mode, dim, sizes, compute_dtype)
