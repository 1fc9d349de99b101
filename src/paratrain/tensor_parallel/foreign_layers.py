"""Parallel layers for modules written by others. A GPT-2 ``Conv1D`` computes ``x W + b`` with
``W`` stored ``[in, out]``; its column/row-parallel forms keep that layout (checkpoints use the
model's own shapes) and run the Megatron functions on ``W^T``. A *packed* projection
(``[q | k | v]`` along the output features: GPT-2's ``c_attn``, timm's ``qkv``) must not be cut
into contiguous chunks (rank 0's would hold all of q and part of k): :class:`PackedColumnParallel`
shards each part on its own, so rank ``i`` computes ``[q_i | k_i | v_i]``, the packed layout of
its own heads, with one fused f for the parts. timm's ``Attention`` reshapes its context to the
input's width, which a shard lacks, so :class:`ParallelFusedQKVAttention` re-implements its
forward on ``heads / p`` local heads.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from paratrain.comm.tp.comm import TPComm

from .autograd import copy_to_region, fused_region
from .layers import (
    ColumnParallelLinear,
    RegionState,
    RowParallelLinear,
    _dense_tensors,
    refuse_sequence_shards,
)


def is_conv1d(m: nn.Module | None) -> bool:
    """A plain ``transformers.pytorch_utils.Conv1D`` (``forward`` not overridden, only
    ``weight [in, out]`` and ``bias [out]``), without importing transformers."""
    if m is None:
        return False
    for cls in type(m).__mro__:
        if cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils":
            own: bool = type(m).forward is cls.forward  # type: ignore[attr-defined]
            return (own and next(m.children(), None) is None
                    and {n for n, _ in m.named_parameters()} == {"weight", "bias"})
    return False


class ColumnParallelConv1D(ColumnParallelLinear):
    """``Y_i = f(X) W[:, cols_i] + b[cols_i]``: a Conv1D's output columns (weight sharded on dim 1)."""

    conv1d = True


class RowParallelConv1D(RowParallelLinear):
    """``Z = g(sum_i X_i W[rows_i, :]) + b``: a Conv1D's input rows (weight sharded on dim 0)."""

    conv1d = True


_PART_NAMES = {3: ("q", "k", "v")}


class PackedColumnParallel(nn.Module):
    """A projection whose output features are ``n`` equal parts (``[q | k | v]``), column-
    parallel part by part: rank ``i`` computes ``[part_0 cols_i | ... | part_{n-1} cols_i]``.
    ``fused_dim``: where the parts are packed in the dense weight (0 for ``nn.Linear``, 1 for
    Conv1D; the bias on 0), so checkpoints keep the dense name and layout (:mod:`.shards`)."""

    def __init__(self, dense: nn.Module, parts: int, *, comm: TPComm, state: RegionState,
                 unit: int = 1) -> None:
        super().__init__()
        self.conv1d = is_conv1d(dense)
        self.parts = int(parts)
        self.comm = comm
        layer_cls = ColumnParallelConv1D if self.conv1d else ColumnParallelLinear
        w, b = _dense_tensors(dense, self.conv1d)
        n_out, n_in = int(w.shape[0]), int(w.shape[1])
        if n_out % self.parts:
            raise ValueError(f"{n_out} output features do not split into {self.parts} packed parts")
        width = n_out // self.parts
        if width % unit or (width // unit) % comm.size:
            raise ValueError(f"each packed part has {width // unit} heads of {unit}, not divisible by "
                             f"tensor_parallel_size {comm.size}")
        self.in_features, self.out_features = n_in, n_out
        self.fused_dim = 1 if self.conv1d else 0
        self.names = _PART_NAMES.get(self.parts, tuple(f"p{c}" for c in range(self.parts)))
        for c, name in enumerate(self.names):
            cols = slice(c * width, (c + 1) * width)
            layer = layer_cls(n_in, width, comm=comm, state=state, bias=b is not None)
            layer.load_dense(w[cols], b[cols] if b is not None else None)
            self.add_module(name, layer.to(w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = [getattr(self, n) for n in self.names]
        refuse_sequence_shards(layers[0].state, self)
        xs = fused_region(x, self.comm, self.parts)
        return torch.cat([lay(xi, input_done=True) for lay, xi in zip(layers, xs, strict=True)], dim=-1)

    def meta_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output's shape, communicating nothing (see ``ColumnParallelLinear.meta_forward``)."""
        r = self.comm.rank
        return x.new_empty((*x.shape[:-1], sum(getattr(self, n).out_sizes[r] for n in self.names)))

    def extra_repr(self) -> str:
        return f"parts={self.parts}, in={self.in_features}, out={self.out_features}, conv1d={self.conv1d}"


class ParallelFusedQKVAttention(nn.Module):
    """timm's ``Attention`` on ``heads / p`` local heads: ``qkv`` packed-column-parallel,
    ``proj`` row-parallel, the per-head ``q_norm`` / ``k_norm`` and the dropouts kept."""

    def __init__(self, dense: nn.Module, *, comm: TPComm, state: RegionState) -> None:
        super().__init__()
        heads = int(dense.num_heads)  # type: ignore[arg-type]
        if heads % comm.size:
            raise ValueError(f"attention has {heads} heads, not divisible by tensor_parallel_size {comm.size}")
        self.comm = comm
        self.local_heads = heads // comm.size
        self.head_dim = int(dense.head_dim)  # type: ignore[arg-type]
        self.scale = float(dense.scale)  # type: ignore[arg-type]
        self.fused_attn = bool(getattr(dense, "fused_attn", True))
        self.qkv = PackedColumnParallel(dense.qkv, 3, comm=comm, state=state, unit=self.head_dim)  # type: ignore[arg-type]
        self.q_norm: nn.Module = dense.q_norm  # type: ignore[assignment]
        self.k_norm: nn.Module = dense.k_norm  # type: ignore[assignment]
        self.attn_drop: nn.Module = dense.attn_drop  # type: ignore[assignment]
        self.norm: nn.Module = getattr(dense, "norm", nn.Identity())
        self.proj = RowParallelLinear.from_dense(dense.proj, comm=comm, state=state)  # type: ignore[arg-type]
        self.proj_drop: nn.Module = dense.proj_drop  # type: ignore[assignment]

    def _per_head(self, norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
        """``norm`` (replicated) on this rank's heads; its parameters enter through Megatron's f,
        since each rank's heads give only part of their gradient."""
        params = dict(norm.named_parameters())
        if not params or self.comm.size == 1:
            return norm(t)
        return functional_call(norm, {n: copy_to_region(p, self.comm) for n, p in params.items()}, (t,))

    def _local_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``attn_mask`` for this rank's heads: a mask with a dimension per head ``(B, H, N,
        N)`` is cut to them; one that broadcasts over heads stays whole."""
        if mask is None or mask.dim() < 3 or mask.size(-3) == 1:
            return mask
        heads = self.local_heads * self.comm.size
        if mask.size(-3) != heads:
            raise ValueError(f"attn_mask has {mask.size(-3)} heads in dimension -3; the attention "
                             f"has {heads} (or 1 to broadcast)")
        first = self.comm.rank * self.local_heads
        return mask.narrow(-3, first, self.local_heads)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        """timm's call: ``attn(x, attn_mask=..., is_causal=...)`` (SDPA's meaning of both:
        a boolean mask keeps where True, a float mask is added to the scores)."""
        b, n, _ = x.shape
        mask = self._local_mask(attn_mask)
        qkv = self.qkv(x).reshape(b, n, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self._per_head(self.q_norm, q), self._per_head(self.k_norm, k)
        if self.fused_attn:
            p = float(getattr(self.attn_drop, "p", 0.0)) if self.training else 0.0
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if is_causal:
                attn = attn.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1),
                                        float("-inf"))
            if mask is not None:
                attn = attn.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else attn + mask
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = x.transpose(1, 2).reshape(b, n, self.local_heads * self.head_dim)
        x = self.norm(x)
        return self.proj_drop(self.proj(x))
