"""The attention opt-in protocol of ``parallelize``: when a module's heads are split.

A module is split by heads (into
:class:`~paratrain.tensor_parallel.layers.ParallelSelfAttention`: q/k/v column-parallel,
each rank owning ``heads/p`` heads, the output projection row-parallel) only where the
conversion provably computes the same function: paratrain's own
:class:`~paratrain.tensor_parallel.layers.SelfAttention` (``forward`` and ``attend`` not
overridden), or a module that opts in with ``__paratrain_tp_attention__(self)`` returning
an :class:`AttentionSpec` (``None`` keeps it replicated). :func:`attention_spec` applies
these rules; any other module with q/k/v/o Linears and ``num_heads`` is a ConfigError
naming its path and how to opt in, and so is an opt-in whose q/k/v/o are not plain Linears
or leave parameters or buffers of the module out.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paratrain.config import ConfigError

from .layers import SelfAttention
from .rules import foreign_tensors, is_plain_linear, module_where

__all__ = ["TP_ATTENTION_PROTOCOL", "AttentionSpec", "AttentionView", "attention_spec", "is_attention"]

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


def is_attention(m: nn.Module) -> bool:
    """Whether ``parallelize`` splits ``m``'s heads (paratrain's SelfAttention or an opt-in
    module); raises the ConfigError of :func:`attention_spec` for look-alikes."""
    return attention_spec(m) is not None


class AttentionView(nn.Module):
    """The spec's projections under the names ParallelSelfAttention reads."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = spec.q, spec.k, spec.v, spec.o
        self.num_heads, self.causal = int(spec.num_heads), bool(spec.causal)
