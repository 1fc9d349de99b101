"""Which modules ``parallelize`` may shard: the checks that keep the converted model's
function equal to the dense one's.

- :func:`is_plain_linear`: an ``nn.Linear`` computing ``x W^T + b`` (``forward`` not
  overridden, no parameters besides ``weight``/``bias``, no children); only these are
  sharded (column-, row-parallel or grid), a Linear subclass stays replicated.
- :func:`is_elementwise`: one of :data:`ELEMENTWISE` with its own ``forward`` untouched;
  only these may sit between the two Linears of an MLP pair (they act on shards).
- :func:`encoder_problem`: why an ``nn.TransformerEncoderLayer`` cannot become a
  :class:`~paratrain.tensor_parallel.layers.ParallelEncoderLayer` (overridden methods,
  not batch-first, no packed in_proj, bias_kv / zero_attn, attention dropout, extra
  parameters), or ``None`` when it can.
- :func:`foreign_tensors` and :func:`module_where` support those checks and the
  ConfigErrors that name a module by its path.

The attention opt-in protocol is in :mod:`.attention_spec`; the walk that applies these
rules in :mod:`.converter`.
"""

from __future__ import annotations

from typing import TypeGuard

from torch import nn

__all__ = ["ELEMENTWISE", "encoder_problem", "foreign_tensors", "is_elementwise", "is_plain_linear",
           "module_where"]

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Dropout, nn.Identity, nn.LeakyReLU,
    nn.ELU, nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU,
)


def module_where(path: str, m: nn.Module) -> str:
    return f"{path.rstrip('.') or '<root>'} ({type(m).__qualname__})"


def foreign_tensors(m: nn.Module, allowed: list[nn.Module]) -> list[str]:
    """Names of ``m``'s parameters and buffers that belong to none of ``allowed``."""
    mine = {id(t) for a in allowed for t in (*a.parameters(), *a.buffers())}
    return [n for n, t in (*m.named_parameters(), *m.named_buffers()) if id(t) not in mine]


def is_plain_linear(m: nn.Module | None) -> TypeGuard[nn.Linear]:
    """An ``nn.Linear`` whose function is ``x W^T + b`` (forward not overridden, no other
    parameters or children): what the parallel Linear layers reproduce."""
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
            and next(m.children(), None) is None
            and {n for n, _ in m.named_parameters()} <= {"weight", "bias"})


def is_elementwise(m: nn.Module | None) -> bool:
    return any(isinstance(m, base) and type(m).forward is base.forward for base in ELEMENTWISE)


_ENCODER_METHODS = ("forward", "_sa_block", "_ff_block")


def encoder_problem(m: nn.TransformerEncoderLayer) -> str | None:
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
        if not is_plain_linear(getattr(m, lin)):
            return f"{lin} is not a plain nn.Linear"
    kids = [m.self_attn, m.linear1, m.linear2, m.norm1, m.norm2, m.dropout, m.dropout1, m.dropout2]
    if isinstance(m.activation, nn.Module):
        kids.append(m.activation)
    extra = foreign_tensors(m, kids)
    if extra:
        return f"it holds parameters or buffers outside the standard layer: {', '.join(extra)}"
    return None
