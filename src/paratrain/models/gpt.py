"""``gpt``: a small decoder-only transformer in the nanoGPT style, as named nodes: ``embed``
(:class:`TokenPositionEmbedding`), ``block0`` .. ``block{n_layer-1}`` (:class:`Block`, pre-norm,
causal :class:`SelfAttention` and an ``fc -> GELU -> proj`` MLP, the layers tensor
parallelism splits), ``ln_f`` and ``head`` (:class:`LMHead`). Token ids ``[B, T]`` in, logits
``[B, T, V]`` out; GPT-2's initialisation (normal(0, 0.02), residual projections ``0.02 /
sqrt(2 n_layer)``, zero biases). :class:`SelfAttention`, the zoo's dense attention, lives
below :mod:`paratrain.tensor_parallel` (a model builds without the collectives), whose
``ParallelSelfAttention`` computes its heads with the same :meth:`SelfAttention.attend`.

With ``tie_weights`` the head's weight *is* the token embedding's Parameter: one tensor, listed
once by ``parameters()`` and twice by ``state_dict()`` (every strategy moves it once).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.fx
from torch import nn

from ..config import ConfigError


def _check_length(t: int, block_size: int) -> None:
    """A ValueError for a sequence longer than ``block_size`` (fx-wrapped: a torch.fx trace
    keeps the check as a call instead of failing on ``if`` over a traced size)."""
    if t > block_size:
        raise ValueError(f"sequence of {t} tokens is longer than block_size {block_size}")


torch.fx.wrap("_check_length")


def _inv_scale(head_dim: int) -> float:
    """``sqrt(head_dim)`` (1 for an empty shard); fx-wrapped: a trace keeps it a call."""
    return math.sqrt(max(head_dim, 1))


torch.fx.wrap("_inv_scale")


class SelfAttention(nn.Module):
    """Dense multi-head self-attention with separate q/k/v/o projections ([B, S, E] -> same),
    which ``parallelize`` replaces with its ``ParallelSelfAttention`` (any module with ``q``,
    ``k``, ``v``, ``o`` Linears and ``num_heads``)."""

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


class TokenPositionEmbedding(nn.Module):
    """Token ids ``[B, T]`` -> ``tok(ids) + pos(0..T-1)``, then dropout: ``[B, T, E]``."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        _check_length(t, self.block_size)
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, causal=True)
        self.drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(OrderedDict(
            fc=nn.Linear(n_embd, 4 * n_embd), act=nn.GELU(), proj=nn.Linear(4 * n_embd, n_embd),
            drop=nn.Dropout(dropout),
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Logits over the vocabulary, ``x @ weight.T`` (no bias); ``weight`` may be tied."""

    def __init__(self, n_embd: int, vocab_size: int, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight is not None and not isinstance(weight, nn.Parameter):
            raise TypeError("a tied LMHead weight must be the embedding's nn.Parameter")
        self.tied = weight is not None
        self.weight = (weight if isinstance(weight, nn.Parameter)
                       else nn.Parameter(torch.empty(vocab_size, n_embd)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}"


def _init(model: nn.Module, n_layer: int) -> None:
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn.o", "mlp.proj")) else 0.02
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, LMHead) and not m.tied:
            nn.init.normal_(m.weight, 0.0, 0.02)


def gpt(input_shape: tuple[int, ...], num_classes: int, *, n_layer: int = 4, n_head: int = 4,
        n_embd: int = 128, block_size: int | None = None, dropout: float = 0.0,
        tie_weights: bool = True) -> nn.Sequential:
    """The decoder-only transformer above; ``input_shape = (T,)`` token ids, ``num_classes``
    the vocabulary size; ``block_size`` (default ``T``) the longest sequence it takes."""
    if len(input_shape) != 1:
        raise ConfigError([("model.name", f"gpt takes token-id sequences of shape (T,) "
                                          f"(got examples of shape {input_shape})")])
    seq = int(input_shape[0])
    block = seq if block_size is None else int(block_size)
    for field, v, low in (("n_layer", n_layer, 0), ("n_head", n_head, 1), ("n_embd", n_embd, 1),
                          ("block_size", block, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError([(f"model.{field}", f"must be an integer >= {low} (got {v!r})")])
    if n_embd % n_head:
        raise ConfigError([("model.n_head", f"n_embd {n_embd} is not divisible by n_head {n_head}")])
    if block < seq:
        raise ConfigError([("model.block_size", f"{block} is shorter than the data's blocks of "
                                                f"{seq} tokens (task.block_size)")])
    if not 0.0 <= float(dropout) < 1.0:
        raise ConfigError([("model.dropout", f"must be in [0, 1) (got {dropout!r})")])
    if num_classes < 1:
        raise ConfigError([("model.name", f"gpt needs a vocabulary (got {num_classes} classes)")])
    embed = TokenPositionEmbedding(num_classes, block, n_embd, float(dropout))
    mods: OrderedDict[str, nn.Module] = OrderedDict(embed=embed)
    for i in range(n_layer):
        mods[f"block{i}"] = Block(n_embd, n_head, float(dropout))
    mods["ln_f"] = nn.LayerNorm(n_embd)
    mods["head"] = LMHead(n_embd, num_classes, embed.tok.weight if tie_weights else None)
    model = nn.Sequential(mods)
    _init(model, max(n_layer, 1))
    return model
