"""``[tensor_parallel.plan]``: module-path patterns -> styles, applied before the built-in rules.

A pattern matches ``model.named_modules()`` paths component by component (``*`` and ``?``
within one); the first match decides (docs/tensor-parallel.md). Sequence parallelism
(Korthikanti et al. 2022, §4.2.2) splits the activations between the tensor-parallel regions
along dim 1 of ``[B, S, ...]``: replicate -> sequence keeps this rank's slice (backward:
all-gather of the gradient, each shard's computation giving the complete gradient of its own
tokens); sequence -> replicate all-gathers (backward: keep the own slice, the consumer making
the gradient complete). A ``sequence`` module sees only its shard's tokens, so its replicated
parameters' gradients are summed over the ranks: right for token-wise modules; one that mixes
tokens (attention) must get the whole sequence (``prepare_input``). ``RegionState`` records the
split, so a layer taking a replicated input refuses shards.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from paratrain.comm.tp.comm import TPComm
from paratrain.config import ConfigError
from paratrain.config.tensor_parallel import PlanEntry

from .autograd import gather_from_region, scatter_to_region
from .foreign import ColumnParallelConv1D, PackedColumnParallel, RowParallelConv1D, is_conv1d
from .layers import ColumnParallelLinear, RegionState, RowParallelLinear
from .partition import split_sizes
from .rules import is_plain_linear, module_where

# styles that keep the module and walk on into its children
WALKED = ("sequence", "prepare_input")


def matches(pattern: str, path: str) -> bool:
    """``pattern`` matches module ``path`` component by component."""
    pa, ma = pattern.split("."), path.split(".") if path else []
    return len(pa) == len(ma) and all(fnmatchcase(m, p) for p, m in zip(pa, ma, strict=True))


def _reaches_below(pattern: str, path: str) -> bool:
    """Some module strictly below ``path`` could match ``pattern``."""
    pa, ma = pattern.split("."), path.split(".") if path else []
    return len(pa) > len(ma) and all(fnmatchcase(m, p) for p, m in zip(pa, ma, strict=False))


class Plan:
    """The plan of one conversion: which entry a path takes, and which patterns were used."""

    def __init__(self, entries: dict[str, PlanEntry], comm: TPComm, state: RegionState) -> None:
        self.entries = dict(entries)
        self.comm, self.state = comm, state
        self.used: set[str] = set()
        self.sequence_modules: list[nn.Module] = []  # their parameters' gradients are summed

    def entry_for(self, path: str) -> tuple[str, PlanEntry] | None:
        for pattern, entry in self.entries.items():
            if matches(pattern, path):
                self.used.add(pattern)
                return pattern, entry
        return None

    def reaches_below(self, path: str) -> bool:
        return any(_reaches_below(p, path) for p in self.entries)

    def apply(self, m: nn.Module, path: str, pattern: str, entry: PlanEntry) -> tuple[nn.Module, str]:
        """The module ``entry`` makes of ``m``, and a note of the style applied."""
        field = f'tensor_parallel.plan."{pattern}"'
        style = entry.style
        if style == "replicate":
            return m, "replicate"
        if style in WALKED:
            src = entry.input_layout if style == "sequence" else entry.input
            dst = "sequence" if style == "sequence" else entry.desired_input
            out = entry.output_layout if style == "sequence" else None
            install(m, path, style=style, src=src, dst=dst, out=out, comm=self.comm, state=self.state)
            if style == "sequence":
                self.sequence_modules.append(m)
                return m, "sequence" + (", input split here" if src == "replicate" else "") + (
                    ", output gathered" if out == "replicate" else "")
            return m, f"prepare_input ({src} -> {dst})"
        conv = is_conv1d(m)
        if not (conv or is_plain_linear(m)):
            raise ConfigError([(field, f"{module_where(path, m)}: {style} applies to a plain nn.Linear "
                                       "or Conv1D (forward not overridden, weight and bias only)")])
        kw: dict[str, Any] = {"comm": self.comm, "state": self.state}
        if style == "packed_colwise":
            assert entry.parts is not None
            try:
                return PackedColumnParallel(m, entry.parts, **kw), f"packed_colwise ({entry.parts} parts)"
            except ValueError as e:
                raise ConfigError([(field, f"{module_where(path, m)}: {e}")]) from None
        if style in ("colwise", "colwise_gather_output"):
            gather = entry.output_layout == "replicate"
            seq = entry.input_layout == "sequence"
            kw["mode"] = "seq" if seq else "copy"
            new = (ColumnParallelConv1D if conv else ColumnParallelLinear).from_dense(
                m, gather_output=gather, **kw)
            return new, "colwise" + (", input sequence-gathered" if seq else "") + (
                ", output replicated" if gather else "")
        split = entry.input_layout == "replicate"
        seq = entry.output_layout == "sequence"
        kw["mode"] = "seq" if seq else "reduce"
        row = (RowParallelConv1D if conv else RowParallelLinear).from_dense(
            m, input_is_parallel=not split, **kw)
        return row, "rowwise" + (", input split here" if split else "") + (
            ", output reduce-scattered to sequence shards" if seq else "")

    def check_used(self, model_paths: list[str]) -> None:
        """Every pattern matched some module (else a ConfigError naming the unused ones)."""
        unused = [p for p in self.entries if p not in self.used]
        if unused:
            sample = ", ".join(p for p in model_paths[:6] if p)
            raise ConfigError([(f'tensor_parallel.plan."{p}"',
                                f"matches no module of the model (paths look like: {sample}, ...; "
                                "`*` matches one path component)") for p in unused])


SEQ_DIM = 1


def to_sequence(x: torch.Tensor, comm: TPComm, state: RegionState, where: str) -> torch.Tensor:
    """replicate -> sequence: this rank's slice of dim 1 (the split is noted in ``state``)."""
    if x.dim() < 2:
        raise RuntimeError(f"tensor_parallel.plan: {where} splits the sequence (dim 1) of a tensor of "
                           f"shape {tuple(x.shape)}, which has no such dim")
    state.seq_dim, state.seq_sizes = SEQ_DIM, split_sizes(int(x.shape[SEQ_DIM]), comm.size)
    state.in_sequence = True
    return scatter_to_region(x, comm, SEQ_DIM, state.seq_sizes)


def to_replicate(x: torch.Tensor, comm: TPComm, state: RegionState, where: str) -> torch.Tensor:
    """sequence -> replicate: the all-gather of the shards along dim 1."""
    if not state.in_sequence or not state.seq_sizes:
        raise RuntimeError(f"tensor_parallel.plan: {where} gathers sequence shards, but no module "
                           "before it split the sequence (add input = \"replicate\" to the first "
                           "sequence entry, or a prepare_input entry that makes \"sequence\")")
    got = int(x.shape[state.seq_dim]) if x.dim() > state.seq_dim else -1
    if got != state.seq_sizes[comm.rank]:
        raise RuntimeError(f"tensor_parallel.plan: {where} expects this rank's {state.seq_sizes[comm.rank]} "
                           f"positions of dim {state.seq_dim}, got a tensor of shape {tuple(x.shape)}")
    state.in_sequence = False
    return gather_from_region(x, comm, state.seq_dim, state.seq_sizes)


def _convert(x: Any, to: str, comm: TPComm, state: RegionState, where: str) -> Any:
    if not isinstance(x, torch.Tensor):
        raise RuntimeError(f"tensor_parallel.plan: {where} converts a tensor, got {type(x).__name__}")
    return to_sequence(x, comm, state, where) if to == "sequence" else to_replicate(x, comm, state, where)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | str, torch.Tensor] | None:
    """The module's first tensor argument: the first positional one, else the first keyword
    argument that is a tensor (HF calls ``self_attn(hidden_states=..., ...)``)."""
    if args:
        return (0, args[0]) if isinstance(args[0], torch.Tensor) else None
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return k, v
    return None


def install(m: nn.Module, path: str, *, style: str, src: str | None, dst: str | None,
            out: str | None, comm: TPComm, state: RegionState) -> None:
    """Hook ``m`` so its first tensor argument goes ``src`` -> ``dst`` (when they differ) and
    its output (a tensor, or the first element of a tuple) goes sequence -> ``out``."""
    where = f"{path or '<root>'} ({style})"
    if src is not None and dst is not None and src != dst:
        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hit = _first_tensor(args, kwargs)
            if hit is None:
                raise RuntimeError(f"tensor_parallel.plan: {where} was called without a tensor argument")
            key, x = hit
            y = _convert(x, dst, comm, state, where)
            if isinstance(key, int):
                return (y, *args[1:]), kwargs
            return args, {**kwargs, key: y}
        m.register_forward_pre_hook(pre, with_kwargs=True)
    elif src == "sequence" and dst == "sequence":
        def check(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not state.in_sequence:
                raise RuntimeError(f"tensor_parallel.plan: {where} runs on sequence shards, but its "
                                   "input is replicated (no module before it split the sequence: give "
                                   "the first one input = \"replicate\")")
        m.register_forward_pre_hook(check, with_kwargs=True)
    if out == "replicate":
        def post(_m: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
            if isinstance(output, tuple | list) and output:
                return type(output)([_convert(output[0], "replicate", comm, state, where), *output[1:]])
            return _convert(output, "replicate", comm, state, where)
        m.register_forward_hook(post)
