"""Sequence parallelism on modules paratrain did not write: the plan's ``sequence`` and
``prepare_input`` styles (torch's ``SequenceParallel`` and ``PrepareModuleInput``).

Megatron's sequence parallelism (Korthikanti et al. 2022, §4.2.2) splits the activations
between the tensor-parallel regions (norms, residual adds, dropout) along the sequence dim
(dim 1 of ``[B, S, ...]``, torch's default). replicate -> sequence keeps this rank's slice
(backward: all-gather of the gradient, each shard's computation giving the complete gradient
of its own tokens); sequence -> replicate all-gathers (backward: keep the own slice, the
consumer making the gradient complete: a replicated module by construction, a column layer by
its ``f``). A ``sequence`` module sees only its shard's tokens, so its replicated parameters'
gradients are summed over the ranks after backward: right for token-wise modules; one that
mixes tokens (attention) must get the whole sequence (``prepare_input``). ``RegionState``
records the split (uneven lengths allowed) and whether the activations are split now, so a
column layer taking a replicated input refuses sequence shards at run time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.comm.tp.comm import TPComm

from .autograd import gather_from_region, scatter_to_region
from .layers import RegionState
from .partition import split_sizes

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
