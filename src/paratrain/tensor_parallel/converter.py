"""The walk that swaps a dense model's modules for their tensor-parallel versions: plan
entries first (:mod:`.plan`), then blocks written by others (:mod:`.foreign`) where no entry
reaches into them, attention (:mod:`.rules`), encoder layers, and in every ``nn.Sequential``
the MLP pairs (or 2-D grid runs, or lone Linears with only one of column / row parallel).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from paratrain.comm.tp.comm import TPComm
from paratrain.comm.tp.groups import GridComms
from paratrain.config import ConfigError, TensorParallelismConfig

from .foreign import block_kind, shard_block
from .grid import GridLinear
from .layers import (
    ColumnParallelLinear,
    ParallelEncoderLayer,
    ParallelSelfAttention,
    RegionState,
    RowParallelLinear,
)
from .partition import partition_shape
from .plan import WALKED, Plan
from .rules import (
    TP_ATTENTION_PROTOCOL,
    AttentionSpec,
    attention_spec,
    encoder_problem,
    is_elementwise,
    is_plain_linear,
    module_where,
)


class Converter:
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
        self.plan = Plan(cfg.plan, comm, state)
        self.notes: list[tuple[str, str]] = []  # (module path, what was done to it)

    def _planned(self, m: nn.Module, path: str) -> nn.Module | None:
        """The module a plan entry makes of ``m`` at ``path``, or None if none matches."""
        hit = self.plan.entry_for(path)
        if hit is None:
            return None
        new, note = self.plan.apply(m, path, *hit)
        walked = hit[1].style in WALKED
        if note != "replicate" and not walked:
            self.units += 1
        self.notes.append((path, f"{note} (plan \"{hit[0]}\")"))
        if walked:  # kept, hooked: its children take their own entries and the block rules
            pre = path + "." if path else ""
            if isinstance(new, nn.Sequential):
                self._sequential(new, pre)
            else:
                for name, child in list(new.named_children()):
                    setattr(new, name, self.convert(child, pre + name + "."))
        return new

    def _attention(self, spec: AttentionSpec, m: nn.Module) -> nn.Module:
        self.units += 1
        new = ParallelSelfAttention(spec, comm=self.comm, state=self.state, mode=self.mode)
        # the names the projections had in ``m`` (an opt-in spec may read them elsewhere):
        # checkpoints and the dense state are keyed by the model's own names
        new.dense_names = {c: n for n, sub in m.named_modules() if n
                           for c in "qkvo" if sub is getattr(spec, c)}
        return new

    def _encoder(self, m: nn.TransformerEncoderLayer, prefix: str) -> nn.Module:
        problem = encoder_problem(m)
        if problem is not None:
            raise ConfigError([("model", f"{module_where(prefix, m)}: cannot be split into a "
                                         f"ParallelEncoderLayer with the same function: {problem}")])
        self.units += 1
        return ParallelEncoderLayer(m, comm=self.comm, state=self.state, mode=self.mode)

    def _special(self, m: nn.Module, prefix: str) -> nn.Module | None:
        """The parallel replacement of a block written by others, an attention block or an
        encoder layer, else None."""
        path = prefix.rstrip(".")
        kind = block_kind(m, prefix)
        if kind is not None and not self.plan.reaches_below(path):
            try:
                new, note = shard_block(kind, m, prefix, self.comm, self.state)
            except ValueError as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError([("model", f"{path or '<root>'}: {e}")]) from None
            self.units += 1
            self.notes.append((path, f"{type(m).__name__}: {note}"))
            return new
        spec = attention_spec(m, prefix)
        if spec is not None:
            return self._attention(spec, m)
        if isinstance(m, nn.TransformerEncoderLayer):
            return self._encoder(m, prefix)
        return None

    def convert(self, m: nn.Module, prefix: str = "") -> nn.Module:
        planned = self._planned(m, prefix.rstrip(".")) if self.plan.entries else None
        if planned is not None:
            return planned
        new = self._special(m, prefix)
        if new is not None:
            return new
        if isinstance(m, nn.Sequential):
            self._sequential(m, prefix)
            return m
        if isinstance(m, nn.Linear) and not is_plain_linear(m):
            warnings.warn(f"parallelize: {module_where(prefix, m)} is an nn.Linear subclass with its own "
                          "forward or extra parameters; it stays replicated (not sharded)",
                          UserWarning, stacklevel=3)
        if getattr(type(m), TP_ATTENTION_PROTOCOL, None) is not None:
            return m  # opted out: kept whole
        for name, child in list(m.named_children()):
            setattr(m, name, self.convert(child, prefix + name + "."))
        return m

    def _row_first(self, first: nn.Linear) -> bool:
        """RowWise pairs start with the row layer; Dynamic ones when not out > in."""
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
        while j < len(mods) and (is_plain_linear(mods[j]) or is_elementwise(mods[j])):
            if is_plain_linear(mods[j]):
                linears.append(j)
            j += 1
        assert self.grid is not None
        for k in linears:
            seq._modules[names[k]] = GridLinear.from_dense(
                mods[k], grid=self.grid, state=self.state,  # type: ignore[arg-type]
                enter=k == linears[0], leave=k == linears[-1])
        self.units += 1
        return linears[-1] + 1

    def _pair(self, first: nn.Linear, second: nn.Linear, name: str) -> tuple[nn.Module, nn.Module]:
        """An MLP pair: column-then-row (Megatron's f and g, their sequence-parallel forms, or
        with AllGather a gathered column output re-split by the row layer), or row-then-column
        (split input, all-reduced row output, all-gathered column output)."""
        kw: dict[str, Any] = {"comm": self.comm, "state": self.state}
        seq_mode = self.mode == "seq"
        if self._row_first(first):
            if seq_mode:
                raise ConfigError([("tensor_parallel.partitioning_strategy",
                                    f"{name}: row-first pairs ({self.strategy}) "
                                    "do not combine with the sequence-parallel layout")])
            return (RowParallelLinear.from_dense(first, mode="reduce", input_is_parallel=False, **kw),
                    ColumnParallelLinear.from_dense(second, mode="copy", gather_output=True, **kw))
        sizes = self._custom_sizes(name + ".weight", first)
        return (ColumnParallelLinear.from_dense(first, mode="seq" if seq_mode else "copy",
                                                gather_output=self.mode == "gather", sizes=sizes, **kw),
                RowParallelLinear.from_dense(second, mode="seq" if seq_mode else "reduce",
                                             input_is_parallel=self.mode != "gather", sizes=sizes, **kw))

    def _lone(self, m: nn.Linear) -> nn.Module | None:
        """A Linear outside a pair: sharded only when one of column/row parallel is off."""
        kw: dict[str, Any] = {"comm": self.comm, "state": self.state}
        if self.col and not self.row:
            return ColumnParallelLinear.from_dense(m, mode="copy", gather_output=True, **kw)
        if self.row and not self.col:
            return RowParallelLinear.from_dense(m, mode="reduce", input_is_parallel=False, **kw)
        return None

    def _sequential(self, seq: nn.Sequential, prefix: str) -> None:
        names = list(seq._modules.keys())
        mods = [seq._modules[n] for n in names]
        planned = [bool(self.plan.entries) and self.plan.entry_for(prefix + n) is not None for n in names]
        i = 0
        while i < len(mods):
            m, name = mods[i], names[i]
            if planned[i]:
                seq._modules[name] = self._planned(m, prefix + name)  # type: ignore[assignment]
            elif is_plain_linear(m) and self.grid is not None:
                i = self._grid_run(seq, names, i)
                continue
            elif is_plain_linear(m):
                j = i + 1
                while j < len(mods) and is_elementwise(mods[j]):
                    j += 1
                nxt = mods[j] if j < len(mods) and not planned[j] else None
                if self.col and self.row and is_plain_linear(nxt):
                    seq._modules[name], seq._modules[names[j]] = self._pair(m, nxt, prefix + name)
                    self.units += 1
                    i = j + 1
                    continue
                if (lone := self._lone(m)) is not None:
                    seq._modules[name] = lone
                    self.units += 1
            elif (new := self._special(m, prefix + name + ".")) is not None:
                seq._modules[name] = new
            elif isinstance(m, nn.Sequential):
                self._sequential(m, prefix + name + ".")
            elif next(m.children(), None) is not None or isinstance(m, nn.Linear):
                self.convert(m, prefix + name + ".")
            i += 1
