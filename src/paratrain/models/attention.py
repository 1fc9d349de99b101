"""Dense multi-head self-attention (:class:`SelfAttention`), the layer the zoo's models use,
below :mod:`paratrain.tensor_parallel` (a model builds without the collectives), whose
``ParallelSelfAttention`` computes its heads with the same :meth:`SelfAttention.attend`.
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch import nn


def _inv_scale(head_dim: int) -> float:
    """``sqrt(head_dim)`` (1 for an empty shard); fx-wrapped: a trace keeps it a call."""
    return math.sqrt(max(head_dim, 1))


torch.fx.wrap("_inv_scale")


class SelfAttention(nn.Module):
    """Dense multi-head self-attention with separate q/k/v/o projections ([B, S, E] -> same).

    ``parallelize`` recognises any module with ``q``, ``k``, ``v``, ``o`` Linears and a
    ``num_heads`` attribute and replaces it with
    :class:`~paratrain.tensor_parallel.layers.ParallelSelfAttention`.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, bias: bool = True, causal: bool = False) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        self.q = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.o = nn.Linear(embed_dim, embed_dim, bias=bias)

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
        b, s, e = q.shape
        hd = e // heads if heads else 0

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, s, heads, hd).transpose(1, 2)

        qh, kh, vh = split(q), split(k), split(v)
        att = (qh @ kh.transpose(-2, -1)) / _inv_scale(hd)
        if causal:
            # [s, s] from att's own shape (traceable by torch.fx, unlike ones(s, s))
            mask = torch.ones_like(att[0, 0], dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        out = att.softmax(-1) @ vh
        return out.transpose(1, 2).reshape(b, s, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.attend(self.q(x), self.k(x), self.v(x), self.num_heads, self.causal)
        return self.o(ctx)

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> SelfAttention:
        """The same function as a batch-first ``nn.MultiheadAttention`` (packed in_proj)."""
        if not mha.batch_first or mha.in_proj_weight is None:
            raise ValueError("only batch_first MultiheadAttention with a packed in_proj is supported")
        e = mha.embed_dim
        m = cls(e, mha.num_heads, bias=mha.in_proj_bias is not None)
        with torch.no_grad():
            for i, lin in enumerate((m.q, m.k, m.v)):
                lin.weight.copy_(mha.in_proj_weight[i * e: (i + 1) * e])
                if lin.bias is not None and mha.in_proj_bias is not None:
                    lin.bias.copy_(mha.in_proj_bias[i * e: (i + 1) * e])
            m.o.weight.copy_(mha.out_proj.weight)
            if m.o.bias is not None and mha.out_proj.bias is not None:
                m.o.bias.copy_(mha.out_proj.bias)
        return m.to(mha.in_proj_weight.device)
