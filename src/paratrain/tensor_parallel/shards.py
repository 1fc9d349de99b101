"""Where each tensor of a tensor-parallel rank lies in the dense model: its name there and its
shard spec ``{"shape": the dense shape, "slices": [[dim, start, length], ...]}``, so checkpoints
resume on another size by the model's own names (:mod:`paratrain.training.reshard`). A
column/row shard is one slice along ``tp_shard_dim`` with the layer's split sizes (never
padding: every spec covers real elements only), a 2-D grid block one slice per grid dim; an
encoder layer's q/k/v are rows ``[c E, (c + 1) E)`` of ``self_attn.in_proj_*``, a packed
projection's part ``c`` its columns' slice shifted by ``c`` part widths (:func:`packed_dims`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .foreign import PackedColumnParallel
from .grid import grid_steps
from .layers import ParallelEncoderLayer, ParallelSelfAttention

Spec = dict[str, Any]


def renames(module: nn.Module) -> dict[str, tuple[str, int | None]]:
    """A converted tensor's name -> (its dense name, its index in a fused q/k/v tensor)."""
    out: dict[str, tuple[str, int | None]] = {}
    for name, m in module.named_modules():
        pre = f"{name}." if name else ""
        if isinstance(m, ParallelEncoderLayer):
            a = pre + "self_attn."
            for kind in ("weight", "bias"):
                for c, part in enumerate("qkv"):
                    out[f"{a}{part}.{kind}"] = (f"{a}in_proj_{kind}", c)
                out[f"{a}o.{kind}"] = (f"{a}out_proj.{kind}", None)
        elif isinstance(m, PackedColumnParallel):
            for c, part in enumerate(m.names):
                for kind in ("weight", "bias"):
                    out[f"{pre}{part}.{kind}"] = (f"{pre}{kind}", c)
        elif isinstance(m, ParallelSelfAttention):
            for part, dense in (getattr(m, "dense_names", None) or {}).items():
                for kind in ("weight", "bias"):
                    out.setdefault(f"{pre}{part}.{kind}", (f"{pre}{dense}.{kind}", None))
    return out


def packed_dims(module: nn.Module) -> dict[str, tuple[int, int]]:
    """A packed part's local tensor name -> (the dense dim its parts are packed on, parts)."""
    out: dict[str, tuple[int, int]] = {}
    for name, m in module.named_modules():
        if isinstance(m, PackedColumnParallel):
            pre = f"{name}." if name else ""
            for part in m.names:
                out[f"{pre}{part}.weight"] = (m.fused_dim, m.parts)
                out[f"{pre}{part}.bias"] = (0, m.parts)
    return out


def pack_dense(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (gathered) tensors under the dense model's names: the parts of an encoder layer's
    in_proj or of a packed projection concatenated, opted-in attention projections renamed."""
    out = dict(tensors)
    dims = packed_dims(module)
    groups: dict[str, list[tuple[int, str]]] = {}
    for local, (dense, index) in renames(module).items():
        if local not in out:
            continue
        if index is not None:
            groups.setdefault(dense, []).append((index, local))
        elif local != dense:
            out[dense] = out.pop(local)
    for dense, parts in groups.items():
        dim = dims.get(parts[0][1], (0, 0))[0]
        out[dense] = torch.cat([out.pop(local) for _, local in sorted(parts)], dim=dim)
    return out


def shard_spec(p: torch.Tensor, rank: int) -> Spec | None:
    """Where this rank's ``p`` (a tensor-parallel parameter; ``rank``: its index in the TP
    group) lies in the dense tensor; None for a tensor held whole."""
    if not isinstance(p, nn.Parameter):
        return None
    steps = grid_steps(p)
    cuts: list[tuple[int, int, list[int]]]
    if steps is not None:
        cuts = [(dim, comm.rank, list(sizes)) for comm, dim, sizes in steps]
    elif hasattr(p, "tp_shard_dim"):
        cuts = [(int(p.tp_shard_dim), rank, list(p.tp_sizes))]  # type: ignore[attr-defined]
    else:
        return None
    shape = list(p.shape)
    slices = []
    for dim, r, sizes in cuts:
        shape[dim] = sum(sizes)
        slices.append([dim, sum(sizes[:r]), sizes[r]])
    return {"shape": shape, "slices": slices}


def _fused(spec: Spec | None, p: nn.Parameter, index: int, dim: int = 0, parts: int = 3) -> Spec:
    """``spec`` of part ``index`` moved into the tensor of ``parts`` parts packed along
    ``dim`` (q/k/v of an in_proj: rows ``index * E``)."""
    if spec is None:
        spec = {"shape": list(p.shape), "slices": [[dim, 0, int(p.shape[dim])]]}
    width = int(spec["shape"][dim])
    slices = [[d, s + index * width if d == dim else s, n] for d, s, n in spec["slices"]]
    if not any(d == dim for d, _, _ in slices):
        slices.append([dim, index * width, width])
    shape = list(spec["shape"])
    shape[dim] = parts * width
    return {"shape": shape, "slices": slices}


def dense_names_and_shards(tpm: nn.Module, *, rank: int = 0) -> tuple[dict[str, str], dict[str, Spec]]:
    """For every ``state_dict`` key of ``tpm`` (a TensorParallelModule, whose model is
    ``tpm.module``): its name in the dense model, and the shard spec of the keys that hold
    part of a dense tensor (``rank``: this rank's index in its TP group)."""
    inner: nn.Module = tpm.module  # type: ignore[assignment]
    params = dict(inner.named_parameters())
    renamed = renames(inner)
    dims = packed_dims(inner)
    names: dict[str, str] = {}
    shards: dict[str, Spec] = {}
    for key in tpm.state_dict():
        local = key.removeprefix("module.")
        dense, index = renamed.get(local, (local, None))
        names[key] = dense
        p = params.get(local)
        if p is None:
            continue
        spec = shard_spec(p, rank)
        if index is not None:
            spec = _fused(spec, p, index, *dims.get(local, (0, 3)))
        if spec is not None:
            shards[key] = spec
    return names, shards
