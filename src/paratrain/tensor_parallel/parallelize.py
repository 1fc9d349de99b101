"""``parallelize(model, config, group)``: turn a dense model into a tensor-parallel one.

Rules (DESIGN §4, Megatron-LM §3):

- In every ``nn.Sequential``, a ``Linear`` followed (through element-wise modules only:
  activations, dropout) by another ``Linear`` is an MLP pair: the first becomes
  :class:`ColumnParallelLinear`, the second :class:`RowParallelLinear`, so the hidden
  activation stays sharded and one reduction per direction is needed. Lone Linears stay
  replicated. With only ``column_parallel``, every Linear becomes column-parallel with
  gathered output; with only ``row_parallel``, row-parallel with a split input.
- Self-attention is split by heads (:class:`ParallelSelfAttention`) only where the
  conversion provably computes the same function: paratrain's own
  :class:`~paratrain.tensor_parallel.layers.SelfAttention` (``forward`` not overridden),
  or a module that **opts in** with a method ``__paratrain_tp_attention__(self)`` returning
  an :class:`AttentionSpec` ``(q, k, v, o, num_heads, causal)``. Returning a spec promises
  that ``forward(x)`` for ``x`` of shape ``[B, S, E]`` is
  ``o(SelfAttention.attend(q(x), k(x), v(x), num_heads, causal))`` and that q/k/v/o hold
  every parameter and buffer of the module (checked: anything else is a ConfigError, it
  would be lost). Returning ``None`` keeps the module as it is (replicated). Any other
  module with ``q``/``k``/``v``/``o`` Linears and ``num_heads`` is **not** replaced: its
  forward may differ (a causal flag under another name, extra parameters, another
  scaling), so ``parallelize`` raises a ConfigError naming the module's path and how to
  opt in. A batch-first ``nn.TransformerEncoderLayer`` (``forward``, ``_sa_block`` and
  ``_ff_block`` not overridden; a plain ``nn.MultiheadAttention`` with a packed in_proj,
  no ``bias_k``/``bias_v``/``add_zero_attn`` and attention dropout 0; no extra
  parameters) becomes :class:`ParallelEncoderLayer` (attention heads split,
  linear1/linear2 as a column/row pair, layer norms replicated); any other encoder layer
  is a ConfigError naming its path and the unsupported feature.
- Only plain ``nn.Linear`` layers (``forward`` not overridden, no parameters besides
  ``weight`` and ``bias``) are sharded, and only the element-wise modules listed in
  :data:`ELEMENTWISE` (``forward`` not overridden) may sit inside a pair. A Linear subclass
  with its own forward or extra parameters stays replicated, with a warning naming it.
- Weights are sliced from the given (full) model, so the result computes the same function.

``partitioning_strategy`` picks how each pair is split: ColumnWise = column-then-row
(Megatron, one reduction per direction); RowWise = row-then-column (the input is split,
the row output all-reduced, the column output all-gathered: two collectives per direction);
Dynamic = per pair by the first weight's [in, out] shape, as ``partition_tensor`` decides
(column-first when out > in, e.g. an MLP up-projection); SequenceWise = the
sequence-parallel layout below; BatchWise = no weight sharding: each TP rank runs the
whole model on its slice of the batch (dim 0), outputs are all-gathered and gradients summed
over the group; BlockWise = 2-D tensor parallelism when tp = g^2 (every run of Linears
becomes :class:`~paratrain.tensor_parallel.grid.GridLinear` on a g x g grid: each rank keeps
a 1/g^2 block of every weight, activations are blocked by batch rows and features), and
ColumnWise when tp is not a perfect square (as the partition arithmetic); Custom =
column-first pairs whose hidden split comes from the function registered with
``register_custom_partitioner`` (e.g. uneven shards for unequal ranks).
Attention heads are always split evenly.

``communication_pattern`` picks the layout: AllReduce / PointToPoint / Hierarchical = the
Megatron f/g layout with the reduction done by that pattern; AllGather = column outputs
all-gathered and re-split by the row layer; ReduceScatter = sequence parallelism: between
the first and the last parallel child of the root Sequential, activations are sharded
along the sequence dim (dim 1 of [B, S, E] inputs, dim 0 of [B, F] ones); the replicated
parameters inside that region see only their shard's tokens, so their gradients are summed
over the TP group in :meth:`TensorParallelModule.sync_gradients`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.comm.tp_grid import GridComms, build_grid
from paratrain.comm.tp_ops import (
    CommStats,
    TPComm,
    TPGroups,
    build_tp_groups,
    gather_from_region,
    scatter_to_region,
)
from paratrain.config import ConfigError, TensorParallelismConfig

from . import memory
from .grid import GridLinear, grid_steps, narrow_to_shard
from .layers import (
    ColumnParallelLinear,
    ParallelEncoderLayer,
    ParallelSelfAttention,
    RegionState,
    RowParallelLinear,
    SelfAttention,
)
from .partition import TensorParallelism, partition_shape, split_sizes

__all__ = ["ELEMENTWISE", "AttentionSpec", "TP_ATTENTION_PROTOCOL", "TensorParallelModule",
           "parallelize", "is_attention", "attention_spec"]

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Dropout, nn.Identity, nn.LeakyReLU,
    nn.ELU, nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU,
)
_PARALLEL = (ColumnParallelLinear, RowParallelLinear, ParallelSelfAttention, ParallelEncoderLayer,
             GridLinear)


TP_ATTENTION_PROTOCOL = "__paratrain_tp_attention__"


@dataclass(frozen=True)
class AttentionSpec:
    """What a module returns from ``__paratrain_tp_attention__()`` to have its heads split:
    its four projections, its head count and whether it masks future positions. It
    promises ``forward(x) == o(SelfAttention.attend(q(x), k(x), v(x), num_heads, causal))``
    and that q/k/v/o hold all of the module's parameters and buffers."""

    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    num_heads: int
    causal: bool = False


def _looks_like_attention(m: nn.Module) -> bool:
    return hasattr(m, "num_heads") and all(isinstance(getattr(m, n, None), nn.Linear) for n in "qkvo")


def _is_own_attention(m: nn.Module) -> bool:
    t = type(m)
    return (isinstance(m, SelfAttention) and t.forward is SelfAttention.forward
            and getattr(t, "attend", None) is SelfAttention.attend)


def _where(path: str, m: nn.Module) -> str:
    return f"{path.rstrip('.') or '<root>'} ({type(m).__qualname__})"


def _opt_in_hint() -> str:
    return (f"define {TP_ATTENTION_PROTOCOL}(self) on the class returning "
            "paratrain.tensor_parallel.AttentionSpec(q, k, v, o, num_heads, causal) if its forward "
            "is o(SelfAttention.attend(q(x), k(x), v(x), num_heads, causal)), use paratrain's "
            "SelfAttention, or return None from it to keep the module replicated")


def _foreign_tensors(m: nn.Module, allowed: list[nn.Module]) -> list[str]:
    """Names of ``m``'s parameters and buffers that belong to none of ``allowed``."""
    mine = {id(t) for a in allowed for t in (*a.parameters(), *a.buffers())}
    return [n for n, t in (*m.named_parameters(), *m.named_buffers()) if id(t) not in mine]


def attention_spec(m: nn.Module, path: str = "") -> AttentionSpec | None:
    """The :class:`AttentionSpec` ``parallelize`` splits ``m`` by, or ``None`` to leave ``m``
    alone (see the module docstring). A ConfigError naming ``path`` when ``m`` looks like
    attention but is not provably equivalent, or when an opt-in spec is inconsistent."""
    field = "model"
    opt_in = getattr(type(m), TP_ATTENTION_PROTOCOL, None)
    if opt_in is not None:
        spec = getattr(m, TP_ATTENTION_PROTOCOL)()
        if spec is None:
            return None
        if not isinstance(spec, AttentionSpec):
            raise ConfigError([(field, f"{_where(path, m)}: {TP_ATTENTION_PROTOCOL}() must return "
                                       f"an AttentionSpec or None (got {type(spec).__name__})")])
        bad = [n for n in "qkvo" if not _plain_linear(getattr(spec, n))]
        if bad:
            raise ConfigError([(field, f"{_where(path, m)}: AttentionSpec.{bad[0]} must be a plain "
                                       "nn.Linear")])
    elif _is_own_attention(m):
        spec = AttentionSpec(m.q, m.k, m.v, m.o, int(m.num_heads),  # type: ignore[arg-type]
                             bool(m.causal))
    elif _looks_like_attention(m):
        raise ConfigError([(field, f"{_where(path, m)} looks like self-attention (q/k/v/o Linears "
                                   "and num_heads) but is not paratrain's SelfAttention, so "
                                   "parallelize cannot prove that splitting its heads keeps its "
                                   "forward (a causal flag, extra parameters, another scaling would "
                                   f"be lost) and does not replace it. To shard it, {_opt_in_hint()}")])
    else:
        return None
    extra = _foreign_tensors(m, [spec.q, spec.k, spec.v, spec.o])
    if extra:
        raise ConfigError([(field, f"{_where(path, m)}: {', '.join(extra)} "
                                   f"{'is' if len(extra) == 1 else 'are'} not part of q/k/v/o and "
                                   "would be lost by splitting the heads; keep the module replicated "
                                   f"(return None from {TP_ATTENTION_PROTOCOL}) or move "
                                   f"{'it' if len(extra) == 1 else 'them'} out of the attention")])
    return spec


def is_attention(m: nn.Module) -> bool:
    """Whether ``parallelize`` splits ``m``'s heads (paratrain's SelfAttention or an opt-in
    module); raises the ConfigError of :func:`attention_spec` for look-alikes."""
    return attention_spec(m) is not None


class _AttentionView(nn.Module):
    """The spec's projections under the names ParallelSelfAttention reads."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = spec.q, spec.k, spec.v, spec.o
        self.num_heads, self.causal = int(spec.num_heads), bool(spec.causal)


def _plain_linear(m: nn.Module | None) -> TypeGuard[nn.Linear]:
    """An ``nn.Linear`` whose function is ``x W^T + b`` (forward not overridden, no other
    parameters or children): what the parallel Linear layers reproduce."""
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
            and next(m.children(), None) is None
            and {n for n, _ in m.named_parameters()} <= {"weight", "bias"})


def _elementwise(m: nn.Module | None) -> bool:
    return any(isinstance(m, base) and type(m).forward is base.forward for base in ELEMENTWISE)


_ENCODER_METHODS = ("forward", "_sa_block", "_ff_block")


def _encoder_problem(m: nn.TransformerEncoderLayer) -> str | None:
    """Why ``m`` cannot become a ParallelEncoderLayer computing the same function, if so."""
    t = type(m)
    changed = [f for f in _ENCODER_METHODS if getattr(t, f) is not getattr(nn.TransformerEncoderLayer, f)]
    if changed:
        return f"{t.__qualname__} overrides {', '.join(changed)}"
    a = m.self_attn
    if type(a).forward is not nn.MultiheadAttention.forward:
        return "its self_attn overrides MultiheadAttention.forward"
    if not a.batch_first:
        return "batch_first=False (only batch-first layers are converted)"
    if not a._qkv_same_embed_dim or a.in_proj_weight is None:
        return "self_attn has separate kdim/vdim projections (no packed in_proj)"
    if a.bias_k is not None or a.bias_v is not None or a.add_zero_attn:
        return "self_attn uses add_bias_kv or add_zero_attn"
    if a.dropout:
        return (f"self_attn has attention dropout {a.dropout} (ParallelEncoderLayer has none); "
                "build the layer with dropout=0.0")
    for lin in ("linear1", "linear2"):
        if not _plain_linear(getattr(m, lin)):
            return f"{lin} is not a plain nn.Linear"
    kids = [m.self_attn, m.linear1, m.linear2, m.norm1, m.norm2, m.dropout, m.dropout1, m.dropout2]
    if isinstance(m.activation, nn.Module):
        kids.append(m.activation)
    extra = _foreign_tensors(m, kids)
    if extra:
        return f"it holds parameters or buffers outside the standard layer: {', '.join(extra)}"
    return None


def _has_parallel(m: nn.Module) -> bool:
    return any(isinstance(x, _PARALLEL) for x in m.modules())


def _param_bytes(params: Iterator[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


class _Converter:
    """Walks a model and swaps in the parallel layers (see the module docstring)."""

    def __init__(self, cfg: TensorParallelismConfig, comm: TPComm, state: RegionState,
                 grid: GridComms | None = None) -> None:
        self.grid = grid
        self.col, self.row = cfg.column_parallel, cfg.row_parallel
        self.strategy = cfg.partitioning_strategy.value
        pattern = cfg.communication_pattern.value
        seq = pattern == "ReduceScatter" or self.strategy == "SequenceWise"
        self.mode = "seq" if seq else ("gather" if pattern == "AllGather" else "copy")
        self.comm, self.state = comm, state
        self.units = 0

    def _attention(self, spec: AttentionSpec) -> nn.Module:
        self.units += 1
        return ParallelSelfAttention(_AttentionView(spec), comm=self.comm, state=self.state,
                                     mode=self.mode)

    def _encoder(self, m: nn.TransformerEncoderLayer, prefix: str) -> nn.Module:
        problem = _encoder_problem(m)
        if problem is not None:
            raise ConfigError([("model", f"{_where(prefix, m)}: cannot be split into a "
                                         f"ParallelEncoderLayer with the same function: {problem}")])
        self.units += 1
        return ParallelEncoderLayer(m, comm=self.comm, state=self.state, mode=self.mode)

    def _special(self, m: nn.Module, prefix: str) -> nn.Module | None:
        """The parallel replacement of an attention block or encoder layer, else None."""
        spec = attention_spec(m, prefix)
        if spec is not None:
            return self._attention(spec)
        if isinstance(m, nn.TransformerEncoderLayer):
            return self._encoder(m, prefix)
        return None

    def _warn_replicated(self, m: nn.Module, prefix: str) -> None:
        if isinstance(m, nn.Linear) and not _plain_linear(m):
            warnings.warn(f"parallelize: {_where(prefix, m)} is an nn.Linear subclass with its own "
                          "forward or extra parameters; it stays replicated (not sharded)",
                          UserWarning, stacklevel=4)

    def convert(self, m: nn.Module, prefix: str = "") -> nn.Module:
        new = self._special(m, prefix)
        if new is not None:
            return new
        if isinstance(m, nn.Sequential):
            self._sequential(m, prefix)
            return m
        self._warn_replicated(m, prefix)
        if getattr(type(m), TP_ATTENTION_PROTOCOL, None) is not None:
            return m  # opted out: kept whole
        for name, child in list(m.named_children()):
            setattr(m, name, self.convert(child, prefix + name + "."))
        return m

    def _row_first(self, first: nn.Linear) -> bool:
        """RowWise pairs start with the row-parallel layer; Dynamic picks per pair by the
        [in, out] shape of the first weight (ColumnWise when out > in, as partition_tensor)."""
        if self.strategy == "RowWise":
            return True
        if self.strategy == "Dynamic":
            return not first.out_features > first.in_features
        return False

    def _custom_sizes(self, name: str, lin: nn.Linear) -> list[int] | None:
        """With Custom, the registered partitioner's split of the column weight [in, out]
        (along out) sets the hidden sizes of the pair, e.g. uneven for unequal ranks."""
        if self.strategy != "Custom":
            return None
        p = self.comm.size
        parts = partition_shape(name, (lin.in_features, lin.out_features), "Custom",
                                tp=p, world_size=p)
        sizes = [0] * p
        spans = sorted((q.offset[1], q.shape[1], q.device_rank) for q in parts)
        at = 0
        for q in parts:
            if len(q.shape) != 2 or q.shape[0] != lin.in_features or q.offset[0] != 0:
                raise ValueError(f"{name}: a Custom partition of a column weight must keep every "
                                 f"input row (got shape {q.shape} at {q.offset})")
        for off, width, rank in spans:
            if off != at or not 0 <= rank < p or sizes[rank]:
                raise ValueError(f"{name}: Custom partitions must tile the output features "
                                 f"contiguously in rank order, one per rank (got {parts})")
            sizes[rank] = width
            at += width
        ranks = [r for _, _, r in spans]
        if at != lin.out_features or ranks != sorted(ranks):
            raise ValueError(f"{name}: Custom partitions must cover {lin.out_features} output "
                             f"features in rank order (got sizes {sizes})")
        return sizes

    def _grid_run(self, seq: nn.Sequential, names: list[str], i: int) -> int:
        """Turn the run of Linears (element-wise modules between them) starting at
        ``names[i]`` into a 2-D region; returns the index after its last Linear."""
        mods = [seq._modules[n] for n in names]
        linears, j = [i], i + 1
        while j < len(mods) and (_plain_linear(mods[j]) or _elementwise(mods[j])):
            if _plain_linear(mods[j]):
                linears.append(j)
            j += 1
        assert self.grid is not None
        for k in linears:
            seq._modules[names[k]] = GridLinear.from_dense(
                mods[k], grid=self.grid, state=self.state,  # type: ignore[arg-type]
                enter=k == linears[0], leave=k == linears[-1])
        self.units += 1
        return linears[-1] + 1

    def _sequential(self, seq: nn.Sequential, prefix: str) -> None:
        names = list(seq._modules.keys())
        mods = [seq._modules[n] for n in names]
        seq_mode = self.mode == "seq"
        kw = {"comm": self.comm, "state": self.state}
        i = 0
        while i < len(mods):
            m = mods[i]
            if _plain_linear(m) and self.grid is not None:
                i = self._grid_run(seq, names, i)
                continue
            if _plain_linear(m):
                j = i + 1
                while j < len(mods) and _elementwise(mods[j]):
                    j += 1
                nxt = mods[j] if j < len(mods) else None
                if self.col and self.row and _plain_linear(nxt):
                    if self._row_first(m):
                        if seq_mode:
                            raise ConfigError([("tensor_parallel.partitioning_strategy",
                                                f"{prefix}{names[i]}: row-first pairs ({self.strategy}) "
                                                "do not combine with the sequence-parallel layout")])
                        # scatter the input, reduce the row output, gather the column output
                        seq._modules[names[i]] = RowParallelLinear.from_dense(
                            m, mode="reduce", input_is_parallel=False, **kw)  # type: ignore[arg-type]
                        seq._modules[names[j]] = ColumnParallelLinear.from_dense(
                            nxt, mode="copy", gather_output=True, **kw)  # type: ignore[arg-type]
                    else:
                        sizes = self._custom_sizes(prefix + names[i] + ".weight", m)
                        seq._modules[names[i]] = ColumnParallelLinear.from_dense(
                            m, mode="seq" if seq_mode else "copy",
                            gather_output=self.mode == "gather", sizes=sizes, **kw)  # type: ignore[arg-type]
                        seq._modules[names[j]] = RowParallelLinear.from_dense(
                            nxt, mode="seq" if seq_mode else "reduce",
                            input_is_parallel=self.mode != "gather", sizes=sizes, **kw)  # type: ignore[arg-type]
                    self.units += 1
                    i = j + 1
                    continue
                if self.col and not self.row:
                    seq._modules[names[i]] = ColumnParallelLinear.from_dense(
                        m, mode="copy", gather_output=True, **kw)  # type: ignore[arg-type]
                    self.units += 1
                elif self.row and not self.col:
                    seq._modules[names[i]] = RowParallelLinear.from_dense(
                        m, mode="reduce", input_is_parallel=False, **kw)  # type: ignore[arg-type]
                    self.units += 1
            elif (new := self._special(m, prefix + names[i] + ".")) is not None:
                seq._modules[names[i]] = new
            elif isinstance(m, nn.Sequential):
                self._sequential(m, prefix + names[i] + ".")
            elif next(m.children(), None) is not None or isinstance(m, nn.Linear):
                self.convert(m, prefix + names[i] + ".")
            i += 1


class TensorParallelModule(nn.Module):
    """A dense model turned tensor-parallel, with the behaviour every config field asks for.

    ``forward`` runs the model (with activation checkpointing per ``memory_optimization``,
    bf16 autocast per ``mixed_precision``, the sequence-parallel region per
    ``communication_pattern``); ``sync_gradients`` does the gradient reductions the layout
    needs (sequence-parallel replicated parameters over TP, and DP averaging in 2-D runs),
    coalesced per ``fusion_threshold_bytes``; ``statistics`` reports real counters.
    """

    def __init__(self, model: nn.Module, config: TensorParallelismConfig, groups: TPGroups) -> None:
        super().__init__()
        self.config, self.groups = config, groups
        self.comm: TPComm = groups.tp
        self.stats: CommStats = groups.tp.stats
        tp = config.tensor_parallel_size
        if tp != groups.tp_size:
            raise ConfigError([("tensor_parallel.tensor_parallel_size",
                                f"{tp} does not match the TP group size {groups.tp_size}")])
        self.pattern = config.communication_pattern.value
        strategy = config.partitioning_strategy.value
        self.seq = (self.pattern == "ReduceScatter" or strategy == "SequenceWise") and tp > 1
        # BatchWise: weights stay whole, the batch is split over the TP ranks (no weight
        # communication; gradients summed over the group in sync_gradients)
        self.batch_split = strategy == "BatchWise" and tp > 1
        if self.batch_split:
            self.seq = False
        self.grid: GridComms | None = None
        if strategy == "BlockWise" and tp > 1 and math.isqrt(tp) ** 2 == tp:
            if self.seq:
                raise ConfigError([("tensor_parallel.communication_pattern",
                                    f"BlockWise with tensor_parallel_size {tp} is 2-D tensor "
                                    "parallelism, whose activations are blocked by batch and "
                                    "features; it does not combine with ReduceScatter (sequence "
                                    "parallel)")])
            self.grid = build_grid(groups.tp)  # collective: every rank builds every sub-group
        self.state = RegionState(compute_dtype=torch.bfloat16 if config.mixed_precision else None)
        dense_params = list(model.parameters())
        self.dense_param_bytes = _param_bytes(iter(dense_params))
        self.coordinator = TensorParallelism(config, self.comm.rank, self.comm.size)
        if tp > 1 and not self.batch_split:
            if not (config.column_parallel or config.row_parallel):
                raise ConfigError([("tensor_parallel", "tensor_parallel_size > 1 but column_parallel "
                                    "and row_parallel are both false: nothing to parallelize")])
            if self.seq and not (config.column_parallel and config.row_parallel):
                raise ConfigError([("tensor_parallel.communication_pattern",
                                    "ReduceScatter (sequence parallel) needs column_parallel and "
                                    "row_parallel both true")])
            conv = _Converter(config, self.comm, self.state, self.grid)
            model = conv.convert(model)
            if conv.units == 0:
                raise ValueError("parallelize: no Linear pair or attention block found to shard")
        self.module = model
        self._plan()
        for name, mod in self.module.named_modules():
            if isinstance(mod, ColumnParallelLinear):
                self.coordinator.partition_tensor(name + ".weight", (mod.in_features, mod.out_features),
                                                  "ColumnWise")
            elif isinstance(mod, RowParallelLinear):
                self.coordinator.partition_tensor(name + ".weight", (mod.in_features, mod.out_features),
                                                  "RowWise")
            elif isinstance(mod, GridLinear):
                self.coordinator.partition_tensor(name + ".weight", (mod.in_features, mod.out_features),
                                                  "BlockWise")
        self._param_ptrs = {p.data_ptr() for p in self.module.parameters()}
        self.last_peak_activation_bytes: int | None = None
        # Replaces the dense data-parallel gradient average when set (e.g. a compressed
        # exchange: paratrain.executors.data_parallel.aggregation.AllReduceAgg with a Compressor).
        self.dp_sync: Callable[[], None] | None = None
        if not self.needs_sync and config.gradient_accumulation is False:
            warnings.warn("gradient_accumulation has no effect: this layout has no gradient "
                          "synchronisation (pure tensor parallel, no sequence parallel, 1 replica)",
                          stacklevel=2)

    # -- structure ------------------------------------------------------------------------
    def _plan(self) -> None:
        """Blocks (checkpoint units), segments, and the sequence-parallel region."""
        m = self.module
        kids = list(m.children()) if isinstance(m, nn.Sequential) else [m]
        self._kids = kids
        starts = [0]
        # without parallel units (tp = 1, BatchWise) every child with parameters starts a block
        dense = not any(_has_parallel(c) for c in kids)
        for i, c in enumerate(kids):
            unit = (isinstance(c, ColumnParallelLinear | ParallelSelfAttention | ParallelEncoderLayer)
                    or (isinstance(c, RowParallelLinear) and not c.input_is_parallel)
                    or (not isinstance(c, _PARALLEL) and _has_parallel(c))
                    or (dense and next(c.parameters(), None) is not None))
            if unit and i > 0:
                starts.append(i)
        self.blocks = [list(range(a, b)) for a, b in zip(starts, starts[1:] + [len(kids)], strict=True)]
        k = memory.SEGMENT_BLOCKS[self.config.memory_optimization.value]
        self.segments: list[list[int]] = []
        if k == 0:
            self.segments = []
        else:
            for s in range(0, len(self.blocks), k):
                self.segments.append([i for b in self.blocks[s: s + k] for i in b])
        par = [i for i, c in enumerate(kids) if _has_parallel(c)]
        self.seq_region = (par[0], par[-1]) if (self.seq and par) else None
        if self.batch_split:
            self.seq_region = (0, len(kids) - 1)
        if self.seq and not isinstance(m, nn.Sequential):
            raise ConfigError([("tensor_parallel.communication_pattern",
                                "ReduceScatter (sequence parallel) needs an nn.Sequential model")])
        self._sp_params: list[nn.Parameter] = []
        if self.seq_region is not None:
            a, b = self.seq_region
            for c in kids[a: b + 1]:
                self._sp_params += [p for p in c.parameters() if not hasattr(p, "tp_shard_dim")]

    @property
    def needs_sync(self) -> bool:
        return bool(self._sp_params) or self.groups.dp is not None

    # -- forward ---------------------------------------------------------------------------
    def _run(self, idx: list[int], x: torch.Tensor) -> torch.Tensor:
        for i in idx:
            if self.seq_region is not None and i == self.seq_region[0]:
                d = 1 if x.dim() >= 3 and not self.batch_split else 0
                self.state.seq_dim = d
                self.state.seq_sizes = split_sizes(x.shape[d], self.comm.size)
                x = scatter_to_region(x, self.comm, d, self.state.seq_sizes)
            x = self._kids[i](x)
            if self.seq_region is not None and i == self.seq_region[1]:
                x = gather_from_region(x, self.comm, self.state.seq_dim, self.state.seq_sizes)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mp = self.config.mixed_precision
        offload = self.config.memory_optimization.value == "Extreme"
        hooks = (memory.activation_hooks(offload=True, params=self._param_ptrs)
                 if offload or memory._ACTIVE else nullcontext())
        amp = torch.autocast(device_type=x.device.type, dtype=torch.bfloat16) if mp else nullcontext()
        with amp, hooks:
            if not self.segments or not (self.training and torch.is_grad_enabled()):
                out = self._run(list(range(len(self._kids))), x)
            else:
                # reentrant checkpoint: a dummy input that requires grad keeps the segments'
                # outputs (and parameter gradients) in the graph even for data inputs.
                dummy = torch.ones(1, requires_grad=True, device=x.device)
                out = x
                for seg in self.segments:
                    trains = any(p.requires_grad for i in seg for p in self._kids[i].parameters())
                    if not trains and not out.requires_grad:
                        out = self._run(seg, out)  # nothing to recompute for (e.g. a flatten)
                    else:
                        out = checkpoint(self._seg_fn(seg), out, dummy, use_reentrant=True)
        return out.float() if mp and out.is_floating_point() else out

    def _seg_fn(self, seg: list[int]) -> Any:
        def fn(x: torch.Tensor, _dummy: torch.Tensor) -> torch.Tensor:
            return self._run(seg, x)
        return fn

    @contextmanager
    def measure_activations(self) -> Iterator[memory.ActivationMeter]:
        """Meter the activation bytes saved for backward by forward+backward in the block."""
        offload = self.config.memory_optimization.value == "Extreme"
        with memory.measure(params=self._param_ptrs, offload=offload) as meter:
            yield meter
        self.last_peak_activation_bytes = meter.peak

    # -- gradients -------------------------------------------------------------------------
    def sync_gradients(self) -> int:
        """Reduce gradients the layout needs; returns the number of collectives issued."""
        n = 0
        if self._sp_params:
            grads = [_grad(p) for p in self._sp_params]
            n += self.comm.all_reduce_coalesced_(grads)
        if self.groups.dp is not None and self.dp_sync is not None:
            self.dp_sync()
            n += 1
        elif self.groups.dp is not None and any(True for _ in self.module.parameters()):
            # DDP's find_unused_parameters rule: a parameter no replica used keeps grad
            # None. One flag per parameter travels with the gradients (fused into their
            # buffer); replicas that did not use a parameter add zeros.
            params = list(self.module.parameters())
            ref = params[0]
            flags = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)
            n += self.groups.dp.all_reduce_coalesced_([*(_grad(p) for p in params), flags], average=True)
            for p, used in zip(params, flags.tolist(), strict=True):
                if used == 0:
                    p.grad = None
        return n

    # -- state -----------------------------------------------------------------------------
    def _mha_prefixes(self) -> list[str]:
        return [n + "." if n else "" for n, m in self.module.named_modules()
                if isinstance(m, ParallelEncoderLayer)]

    def to_dense_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename full (gathered) tensors to the dense model's keys: an encoder layer's
        q/k/v/o go back into ``self_attn.in_proj_*`` / ``self_attn.out_proj.*``."""
        out = dict(tensors)
        for pre in self._mha_prefixes():
            a = pre + "self_attn."
            for kind in ("weight", "bias"):
                parts = [out.pop(f"{a}{c}.{kind}", None) for c in "qkv"]
                if all(t is not None for t in parts):
                    out[f"{a}in_proj_{kind}"] = torch.cat(parts)  # type: ignore[arg-type]
                o = out.pop(f"{a}o.{kind}", None)
                if o is not None:
                    out[f"{a}out_proj.{kind}"] = o
        return out

    def _from_dense_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(state)
        for pre in self._mha_prefixes():
            a = pre + "self_attn."
            for kind in ("weight", "bias"):
                packed = out.pop(f"{a}in_proj_{kind}", None)
                if packed is not None:
                    for c, t in zip("qkv", packed.chunk(3), strict=True):
                        out[f"{a}{c}.{kind}"] = t
                o = out.pop(f"{a}out_proj.{kind}", None)
                if o is not None:
                    out[f"{a}o.{kind}"] = o
        return out

    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gather per-parameter shards (e.g. gradients, keyed like ``module``'s parameters)
        into full tensors under the dense model's names (collective over TP)."""
        params = dict(self.module.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            p = params.get(name)
            steps = grid_steps(p) if p is not None else None
            if steps is not None:
                for comm, dim, sizes in steps:
                    t = comm.all_gather(t.contiguous(), dim, sizes).wait()
            elif p is not None and hasattr(p, "tp_shard_dim") and self.comm.size > 1:
                t = self.comm.all_gather(t.contiguous(), p.tp_shard_dim, p.tp_sizes).wait()  # type: ignore[attr-defined]
            out[name] = t.detach().clone()
        return self.to_dense_names(out)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict with the dense model's keys (collective)."""
        tensors = {n: p.detach() for n, p in self.module.named_parameters()}
        tensors.update({n: b.detach() for n, b in self.module.named_buffers()})
        return self.gather_full(tensors)

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict, keeping this rank's shard of each sharded parameter."""
        state = self._from_dense_names(state)
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                src = state[name]
                steps = grid_steps(p)
                if steps is not None:
                    src = narrow_to_shard(src, steps)
                elif hasattr(p, "tp_shard_dim"):
                    sizes = p.tp_sizes  # type: ignore[attr-defined]
                    r = self.comm.rank
                    src = src.narrow(p.tp_shard_dim, sum(sizes[:r]), sizes[r])
                p.copy_(src)
            for name, b in self.module.named_buffers():
                b.copy_(state[name])

    # -- statistics ------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        snap = self.stats.snapshot()
        params = list(self.module.parameters())
        local = _param_bytes(iter(params))
        sharded = _param_bytes(p for p in params if hasattr(p, "tp_shard_dim") or grid_steps(p))
        replicated = local - sharded
        dense_sharded = self.dense_param_bytes - replicated
        tp = self.comm.size
        snap.update({
            "tensor_parallel_size": tp,
            "communication_pattern": self.pattern,
            "param_bytes_local": local,
            "param_bytes_dense": self.dense_param_bytes,
            "param_bytes_replicated": replicated,
            "param_memory_fraction": local / self.dense_param_bytes if self.dense_param_bytes else 1.0,
            "param_memory_ideal_fraction": ((dense_sharded / tp + replicated) / self.dense_param_bytes
                                            if self.dense_param_bytes else 1.0),
            "memory_saving": 1 - local / self.dense_param_bytes if self.dense_param_bytes else 0.0,
            "total_partitions": self.coordinator.total_partitions,
            "local_partitions": self.coordinator.local_partitions,
            "peak_activation_bytes": self.last_peak_activation_bytes,
            # the Rust TensorParallelismStatistics names, with real values
            "communication_volume": snap["bytes_sent_modelled"],  # ring model, see CommStats
            "communication_time": snap["communication_time_s"],
            "computation_time": snap["computation_time_s"],
            "efficiency_score": (snap["computation_time_s"]
                                 / (snap["computation_time_s"] + snap["communication_time_s"])
                                 if snap["computation_time_s"] + snap["communication_time_s"] > 0
                                 else 0.0),
            "memory_usage_per_device": {self.comm.global_rank: local},
        })
        if self.pattern == "Hierarchical":
            # the two-level layout the topology gave, e.g. "flat (1 host)" (comm/groups.py)
            snap["hierarchy"] = getattr(self.comm, "hierarchy", None) or "flat (1 rank)"
        return snap


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def parallelize(model: nn.Module, config: TensorParallelismConfig | dict[str, Any],
                group: TPGroups | TPComm | None = None) -> TensorParallelModule:
    """Shard ``model`` (a full, identically initialised copy on every rank) per ``config``.

    ``group``: the :class:`TPGroups` from :func:`paratrain.comm.tp_ops.build_tp_groups`, a
    bare :class:`TPComm` (pure TP), or ``None`` to build the groups now (collective).
    """
    cfg = config if isinstance(config, TensorParallelismConfig) else TensorParallelismConfig.model_validate(config)
    if group is None:
        try:
            group = build_tp_groups(
                cfg.tensor_parallel_size, pattern=cfg.communication_pattern.value,
                async_op=cfg.async_communication, fusion_threshold_bytes=cfg.fusion_threshold_bytes)
        except ValueError as e:
            raise ConfigError([("tensor_parallel.tensor_parallel_size", str(e))]) from None
    if isinstance(group, TPComm):
        group = TPGroups(group, None, group.size, 1, 0)
    return TensorParallelModule(model, cfg, group)
