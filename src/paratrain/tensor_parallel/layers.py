"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, §3; Korthikanti et al. 2022).
With ``p`` ranks and a dense ``Y = X A + b`` (``A = weight.T``, ``[in, out]``),
:class:`ColumnParallelLinear` keeps ``A_i``, the rank's ceil-sized block of output columns:
``Y_i = f(X) A_i + b_i``; :class:`RowParallelLinear` the block of input rows: ``Z = g(sum_i X_i
A_i) + b``, the bias added once, after the reduction. In sequence-parallel mode ("seq") the
activations outside the pair are sharded along the sequence dim: ``f`` becomes an all-gather,
``g`` a reduce-scatter. :class:`ParallelSelfAttention` splits the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch import nn

from paratrain.comm.tp.comm import TPComm

from ..models.gpt import SelfAttention
from .autograd import (
    column_linear,
    fused_region,
    gather_from_region,
    row_linear,
    scatter_to_region,
)
from .partition import split_sizes


@dataclass
class RegionState:
    """Shared by the layers of one parallel model: where the sequence dim is and how the
    full sequence is split (set at the entry of the sequence-parallel region)."""

    seq_dim: int = 0
    seq_sizes: list[int] = field(default_factory=list)
    compute_dtype: torch.dtype | None = None
    grid_rows: list[int] = field(default_factory=list)  # batch split over grid rows (2-D)
    # the activations are split along seq_dim now (a plan's sequence region, .plan)
    in_sequence: bool = False


def refuse_sequence_shards(state: RegionState, layer: nn.Module) -> None:
    """A layer that takes a replicated input, reached by sequence shards: it would compute
    over its shard's tokens only (a different function), so stop, naming it."""
    if state.in_sequence:
        where = getattr(layer, "tp_path", "") or type(layer).__name__
        raise RuntimeError(
            f"tensor_parallel.plan: {where} takes a replicated input but receives sequence shards "
            "(a module before it split the sequence): give it input = \"sequence\", or a "
            "prepare_input entry (input = \"sequence\", desired_input = \"replicate\") on the "
            "block that contains it")


def _no_sequence_shards(layer: nn.Module, mode: str) -> None:
    if mode == "seq":
        where = getattr(layer, "tp_path", "") or type(layer).__name__
        raise ValueError(f"{where}: sequence parallelism inside a graph captured by torch.export "
                         "(a pipeline stage of a Hugging Face model) is not supported; keep its "
                         "activations replicated there (no \"sequence\" layout in "
                         "[tensor_parallel.plan], no communication_pattern = \"ReduceScatter\" or "
                         "partitioning_strategy = \"SequenceWise\")")


def _mark(p: nn.Parameter, dim: int, sizes: list[int]) -> None:
    """Tag a sharded parameter: split along ``dim`` into ``sizes`` over the TP ranks."""
    p.tp_shard_dim = dim  # type: ignore[attr-defined]
    p.tp_sizes = sizes  # type: ignore[attr-defined]


def _check_sizes(sizes: list[int] | None, n: int, p: int) -> list[int]:
    """Per-rank lengths of a split of ``n`` features (default: ceil-sized chunks)."""
    if sizes is None:
        return split_sizes(n, p)
    sizes = [int(s) for s in sizes]
    if len(sizes) != p or sum(sizes) != n or min(sizes) < 0:
        raise ValueError(f"shard sizes {sizes} must be {p} non-negative lengths adding up to {n}")
    return sizes


def _dense_tensors(m: nn.Module, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense layer's weight as ``[out, in]`` (a Conv1D's ``[in, out]`` transposed) and bias."""
    w: torch.Tensor = m.weight  # type: ignore[assignment]
    return (w.t() if conv1d else w), m.bias  # type: ignore[return-value]


def _mode_dims(state: RegionState) -> tuple[int, list[int] | None]:
    return state.seq_dim, (state.seq_sizes or None)


class _Sharded(nn.Module):
    """What the column and row layers share: building from a dense layer, and a Conv1D's
    ``[in, out]`` weight layout kept (``conv1d``: GPT-2's, :mod:`.foreign`)."""

    conv1d = False

    def __init__(self, in_features: int, out_features: int, *, comm: TPComm, state: RegionState,
                 bias: bool, mode: str, sizes: list[int] | None, column: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.state, self.mode, self.column = comm, state, mode, column
        self.shard_sizes = _check_sizes(sizes, out_features if column else in_features, comm.size)
        local = self.shard_sizes[comm.rank]
        # [out, in] with the sharded dim cut; a Conv1D keeps its [in, out] layout, transposed
        shape, dim = ([local, in_features], 0) if column else ([out_features, local], 1)
        if self.conv1d:
            shape, dim = shape[::-1], 1 - dim
        self.weight = nn.Parameter(torch.empty(*shape))
        self.bias = nn.Parameter(torch.zeros(local if column else out_features)) if bias else None
        _mark(self.weight, dim, self.shard_sizes)
        if column and self.bias is not None:
            _mark(self.bias, 0, self.shard_sizes)

    @property
    def shard_offset(self) -> int:
        return sum(self.shard_sizes[: self.comm.rank])

    def linear_weight(self) -> torch.Tensor:
        """The shard as ``nn.Linear`` lays it out, ``[out, in]`` (a view of a Conv1D's)."""
        return self.weight.t() if self.conv1d else self.weight

    @classmethod
    def from_dense(cls, dense: nn.Module, *, comm: TPComm, state: RegionState, **kw: Any) -> Self:
        w, b = _dense_tensors(dense, cls.conv1d)
        m = cls(int(w.shape[1]), int(w.shape[0]), comm=comm, state=state, bias=b is not None, **kw)
        m.load_dense(w, b)
        return m.to(w.device)

    def load_dense(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        """Keep this rank's shard of a dense ``[out, in]`` weight and of its bias (a row
        layer's bias whole: it is added once, after the reduction)."""
        s, n = self.shard_offset, self.shard_sizes[self.comm.rank]
        with torch.no_grad():
            self.linear_weight().copy_(w[s: s + n] if self.column else w[:, s: s + n])
            if self.bias is not None and b is not None:
                self.bias.copy_(b[s: s + n] if self.column else b)


class ColumnParallelLinear(_Sharded):
    """``Y_i = f(X) A_i + b_i``; ``mode`` is "copy" (Megatron f) or "seq" (sequence parallel)."""

    def __init__(self, in_features: int, out_features: int, *, comm: TPComm, state: RegionState,
                 bias: bool = True, mode: str = "copy", gather_output: bool = False,
                 sizes: list[int] | None = None) -> None:
        super().__init__(in_features, out_features, comm=comm, state=state, bias=bias, mode=mode,
                         sizes=sizes, column=True)
        self.gather_output = gather_output
        self.out_sizes = self.shard_sizes

    def forward(self, x: torch.Tensor, *, input_done: bool = False) -> torch.Tensor:
        dim, sizes = _mode_dims(self.state)
        mode = "none" if input_done else self.mode
        if mode == "copy":
            refuse_sequence_shards(self.state, self)
        elif mode == "seq" and not self.state.in_sequence:
            where = getattr(self, "tp_path", "") or type(self).__name__
            raise RuntimeError(f"tensor_parallel.plan: {where} takes sequence shards (input = \"sequence\") "
                               "but no module before it split the sequence (give the first sequence "
                               "entry input = \"replicate\")")
        y = column_linear(x, self.linear_weight(), self.bias, self.comm, mode=mode, dim=dim, sizes=sizes,
                          compute_dtype=self.state.compute_dtype)
        if self.gather_output:
            y = gather_from_region(y, self.comm, y.dim() - 1, self.out_sizes)
        return y

    def meta_forward(self, x: torch.Tensor) -> torch.Tensor:
        """An empty output of the right shape, communicating nothing: how ``torch.export``
        learns this layer's output while keeping it whole (``paratrain.graph.trace.export_graph``)."""
        _no_sequence_shards(self, self.mode)
        return x.new_empty((*x.shape[:-1], self.out_features if self.gather_output
                            else self.out_sizes[self.comm.rank]))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"mode={self.mode}, gather_output={self.gather_output}")


class RowParallelLinear(_Sharded):
    """``Z = g(sum_i X_i A_i) + b``; ``mode`` is "reduce" (Megatron g) or "seq"."""

    def __init__(self, in_features: int, out_features: int, *, comm: TPComm, state: RegionState,
                 bias: bool = True, mode: str = "reduce", input_is_parallel: bool = True,
                 sizes: list[int] | None = None) -> None:
        super().__init__(in_features, out_features, comm=comm, state=state, bias=bias, mode=mode,
                         sizes=sizes, column=False)
        self.input_is_parallel = input_is_parallel
        self.in_sizes = self.shard_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.comm, x.dim() - 1, self.in_sizes)
        dim, sizes = _mode_dims(self.state)
        y = row_linear(x, self.linear_weight(), self.bias, self.comm, mode=self.mode, dim=dim,
                       sizes=sizes, compute_dtype=self.state.compute_dtype)
        if self.mode == "seq":
            self.state.in_sequence = True  # reduce-scattered: sequence shards from here
        return y

    def meta_forward(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`ColumnParallelLinear.meta_forward`."""
        _no_sequence_shards(self, self.mode)
        return x.new_empty((*x.shape[:-1], self.out_features))

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"mode={self.mode}, input_is_parallel={self.input_is_parallel}")


class ParallelSelfAttention(nn.Module):
    """Heads split over the TP ranks: q/k/v column-parallel, o row-parallel. ``mode`` "copy":
    one f per projection (one fused f when the input fits the fusion threshold); "seq": the
    sequence shards all-gathered (fused: once), the output reduce-scattered; "gather"
    (AllGather): the attention outputs all-gathered and o splits them again."""

    def __init__(self, dense: Any, *, comm: TPComm, state: RegionState, mode: str) -> None:
        # dense: a SelfAttention or an AttentionSpec (q/k/v/o, num_heads, causal)
        super().__init__()
        heads = int(dense.num_heads)
        if heads % comm.size:
            raise ValueError(f"attention has {heads} heads, not divisible by "
                             f"tensor_parallel_size {comm.size}")
        self.comm, self.state, self.mode = comm, state, mode
        self.local_heads = heads // comm.size
        self.causal = bool(getattr(dense, "causal", False))
        self.dense_names: dict[str, str] = {}  # q/k/v/o -> their names in the dense module
        col: dict[str, Any] = {"comm": comm, "state": state, "mode": "seq" if mode == "seq" else "copy"}
        q, k, v, o = (getattr(dense, n) for n in "qkvo")
        self.q, self.k, self.v = (ColumnParallelLinear.from_dense(t, **col) for t in (q, k, v))
        self.o = RowParallelLinear.from_dense(
            o, comm=comm, state=state, mode="seq" if mode == "seq" else "reduce",
            input_is_parallel=mode != "gather")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # must be the same decision on every rank: size the FULL input from its shape
        # (a rank's sequence shard may be empty)
        seq = self.mode == "seq"
        dim, sizes = _mode_dims(self.state) if seq else (0, None)
        if seq:
            per_token = math.prod(x.shape[:dim] + x.shape[dim + 1:])
            full_bytes = per_token * sum(sizes or [0]) * x.element_size()
        else:
            full_bytes = x.numel() * x.element_size()
        fuse = self.comm.size > 1 and 0 < full_bytes <= self.comm.fusion_threshold_bytes
        # fused: one f, or (sequence parallel: sizes) one all-gather, for the three projections
        xq, xk, xv = fused_region(x, self.comm, 3, dim, sizes) if fuse else (x, x, x)
        q, k, v = (lin(xi, input_done=fuse) for lin, xi in ((self.q, xq), (self.k, xk), (self.v, xv)))
        ctx = SelfAttention.attend(q, k, v, self.local_heads, self.causal)
        if self.mode == "gather":
            ctx = gather_from_region(ctx, self.comm, ctx.dim() - 1, self.q.out_sizes)
        return self.o(ctx)


class ParallelEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (batch_first) with parallel attention and MLP, the same
    computation: post-norm ``x = LN1(x + SA(x)); x = LN2(x + FF(x))`` or pre-norm ``x = x +
    SA(LN1(x)); x = x + FF(LN2(x))``, ``FF = W2 act(W1 x)``; the layer norms replicated."""

    def __init__(self, dense: nn.TransformerEncoderLayer, *, comm: TPComm, state: RegionState,
                 mode: str) -> None:
        super().__init__()
        self.norm_first = dense.norm_first
        self.self_attn = ParallelSelfAttention(SelfAttention.from_mha(dense.self_attn), comm=comm,
                                               state=state, mode=mode)
        self.linear1 = ColumnParallelLinear.from_dense(
            dense.linear1, comm=comm, state=state, mode="seq" if mode == "seq" else "copy",
            gather_output=mode == "gather")
        self.linear2 = RowParallelLinear.from_dense(
            dense.linear2, comm=comm, state=state, mode="seq" if mode == "seq" else "reduce",
            input_is_parallel=mode != "gather")
        self.norm1, self.norm2 = dense.norm1, dense.norm2
        self.dropout, self.dropout1, self.dropout2 = dense.dropout, dense.dropout1, dense.dropout2
        self.activation = dense.activation

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if src_mask is not None or src_key_padding_mask is not None or is_causal:
            raise ValueError("ParallelEncoderLayer supports unmasked self-attention only (got a mask or is_causal=True)")
        if self.norm_first:
            x = x + self.dropout1(self.self_attn(self.norm1(x)))
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self.dropout1(self.self_attn(x)))
        return self.norm2(x + self._ff(x))
