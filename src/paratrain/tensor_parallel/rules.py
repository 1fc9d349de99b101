"""Which modules ``parallelize`` may shard: the checks that keep the converted model's function
equal to the dense one's. Only plain ``nn.Linear`` layers are sharded, with only
:data:`ELEMENTWISE` modules between the two of a pair; a batch-first
``nn.TransformerEncoderLayer`` unless :func:`encoder_problem` names a feature it would lose.
Attention is split by heads only where that provably keeps its forward: paratrain's own
``SelfAttention``, or a module that opts in with ``__paratrain_tp_attention__(self)``; any other
module with q/k/v/o Linears and ``num_heads`` is a ConfigError naming its path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from torch import nn

from paratrain.config import ConfigError

from .layers import SelfAttention

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


def encoder_problem(m: nn.TransformerEncoderLayer) -> str | None:
    """Why ``m`` cannot become a ParallelEncoderLayer computing the same function, if so."""
    t = type(m)
    changed = [f for f in ("forward", "_sa_block", "_ff_block") if getattr(t, f) is not getattr(nn.TransformerEncoderLayer, f)]
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


TP_ATTENTION_PROTOCOL = "__paratrain_tp_attention__"


@dataclass(frozen=True)
class AttentionSpec:
    """What a module returns from ``__paratrain_tp_attention__()`` to have its heads split, a
    promise: ``forward(x) == o(SelfAttention.attend(q(x), k(x), v(x), num_heads, causal))``
    and q/k/v/o hold all of the module's parameters and buffers."""

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


def _opt_in_hint() -> str:
    return (f"define {TP_ATTENTION_PROTOCOL}(self) on the class returning "
            "paratrain.tensor_parallel.AttentionSpec(q, k, v, o, num_heads, causal) if its forward "
            "is o(SelfAttention.attend(q(x), k(x), v(x), num_heads, causal)), use paratrain's "
            "SelfAttention, or return None from it to keep the module replicated")


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
            raise ConfigError([(field, f"{module_where(path, m)}: {TP_ATTENTION_PROTOCOL}() must return "
                                       f"an AttentionSpec or None (got {type(spec).__name__})")])
        bad = [n for n in "qkvo" if not is_plain_linear(getattr(spec, n))]
        if bad:
            raise ConfigError([(field, f"{module_where(path, m)}: AttentionSpec.{bad[0]} must be a plain "
                                       "nn.Linear")])
    elif _is_own_attention(m):
        spec = AttentionSpec(m.q, m.k, m.v, m.o, int(m.num_heads),  # type: ignore[arg-type]
                             bool(m.causal))
    elif _looks_like_attention(m):
        raise ConfigError([(field, f"{module_where(path, m)} looks like self-attention (q/k/v/o Linears "
                                   "and num_heads) but is not paratrain's SelfAttention, so "
                                   "parallelize cannot prove that splitting its heads keeps its "
                                   "forward (a causal flag, extra parameters, another scaling would "
                                   f"be lost) and does not replace it. To shard it, {_opt_in_hint()}")])
    else:
        return None
    extra = foreign_tensors(m, [spec.q, spec.k, spec.v, spec.o])
    if extra:
        raise ConfigError([(field, f"{module_where(path, m)}: {', '.join(extra)} "
                                   f"{'is' if len(extra) == 1 else 'are'} not part of q/k/v/o and "
                                   "would be lost by splitting the heads; keep the module replicated "
                                   f"(return None from {TP_ATTENTION_PROTOCOL}) or move "
                                   f"{'it' if len(extra) == 1 else 'them'} out of the attention")])
    return spec
