"""``parallelize(model, config, group)``: turn a dense model into a tensor-parallel one.

Rules (DESIGN §4, Megatron-LM §3):

- In every ``nn.Sequential``, a ``Linear`` followed (through element-wise modules only:
  activations, dropout) by another ``Linear`` is an MLP pair: the first becomes
  :class:`~.layers.ColumnParallelLinear`, the second :class:`~.layers.RowParallelLinear`, so the hidden
  activation stays sharded and one reduction per direction is needed. Lone Linears stay
  replicated. With only ``column_parallel``, every Linear becomes column-parallel with
  gathered output; with only ``row_parallel``, row-parallel with a split input.
- Self-attention is split by heads (:class:`~.layers.ParallelSelfAttention`) only where the
  conversion provably computes the same function: paratrain's own
  :class:`~paratrain.tensor_parallel.layers.SelfAttention` (``forward`` not overridden),
  or a module that **opts in** with a method ``__paratrain_tp_attention__(self)`` returning
  an :class:`~.attention_spec.AttentionSpec` ``(q, k, v, o, num_heads, causal)``. Returning a spec promises
  that ``forward(x)`` for ``x`` of shape ``[B, S, E]`` is
  ``o(SelfAttention.attend(q(x), k(x), v(x), num_heads, causal))`` and that q/k/v/o hold
  every parameter and buffer of the module (checked: anything else is a ConfigError, it
  would be lost). Returning ``None`` keeps the module as it is (replicated). Any other
  module with ``q``/``k``/``v``/``o`` Linears and ``num_heads`` is **not** replaced: its
  forward may differ (a causal flag under another name, extra parameters, another
  scaling), so ``parallelize`` raises a ConfigError naming the module's path and how to
  opt in. A batch-first ``nn.TransformerEncoderLayer`` (``forward``, ``_sa_block`` and
  ``_ff_block`` not overridden; a plain ``nn.MultiheadAttention`` with a packed in_proj,
  no ``bias_k``/``bias_v``/``add_zero_attn`` and attention dropout 0; no extra
  parameters) becomes :class:`~.layers.ParallelEncoderLayer` (attention heads split,
  linear1/linear2 as a column/row pair, layer norms replicated); any other encoder layer
  is a ConfigError naming its path and the unsupported feature.
- Only plain ``nn.Linear`` layers (``forward`` not overridden, no parameters besides
  ``weight`` and ``bias``) are sharded, and only the element-wise modules listed in
  :data:`~.rules.ELEMENTWISE` (``forward`` not overridden) may sit inside a pair. A Linear subclass
  with its own forward or extra parameters stays replicated, with a warning naming it.
- Weights are sliced from the given (full) model, so the result computes the same function.

``partitioning_strategy`` picks how each pair is split: ColumnWise = column-then-row
(Megatron, one reduction per direction); RowWise = row-then-column (the input is split,
the row output all-reduced, the column output all-gathered: two collectives per direction);
Dynamic = per pair by the first weight's [in, out] shape, as ``partition_tensor`` decides
(column-first when out > in, e.g. an MLP up-projection); SequenceWise = the
sequence-parallel layout below; BatchWise = no weight sharding: each TP rank runs the
whole model on its slice of the batch (dim 0), outputs are all-gathered and gradients summed
over the group; BlockWise = 2-D tensor parallelism when tp = g^2 (every run of Linears
becomes :class:`~paratrain.tensor_parallel.grid.GridLinear` on a g x g grid: each rank keeps
a 1/g^2 block of every weight, activations are blocked by batch rows and features), and
ColumnWise when tp is not a perfect square (as the partition arithmetic); Custom =
column-first pairs whose hidden split comes from the function registered with
``register_custom_partitioner`` (e.g. uneven shards for unequal ranks).
Attention heads are always split evenly.

``communication_pattern`` picks the layout: AllReduce / PointToPoint / Hierarchical = the
Megatron f/g layout with the reduction done by that pattern; AllGather = column outputs
all-gathered and re-split by the row layer; ReduceScatter = sequence parallelism: between
the first and the last parallel child of the root Sequential, activations are sharded
along the sequence dim (dim 1 of [B, S, E] inputs, dim 0 of [B, F] ones); the replicated
parameters inside that region see only their shard's tokens, so their gradients are summed
over the TP group in :meth:`TensorParallelModule.sync_gradients`.

Where each part lives: the eligibility checks in :mod:`.rules` (plain Linear, element-wise,
encoder layer) and :mod:`.attention_spec` (the attention opt-in), the walk that applies
them in :mod:`.converter`, the resulting :class:`~.module.TensorParallelModule` in
:mod:`.module`; this module holds the entry point, :func:`parallelize`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.comm.tp.comm import TPComm
from paratrain.comm.tp.groups import TPGroups, build_tp_groups
from paratrain.config import ConfigError, TensorParallelismConfig

from .module import TensorParallelModule

__all__ = ["parallelize"]


def parallelize(model: nn.Module, config: TensorParallelismConfig | dict[str, Any],
                group: TPGroups | TPComm | None = None, *, compressor: Any = None,
                broadcast_buffers: bool = True) -> TensorParallelModule:
    """Shard ``model`` (a full, identically initialised copy on every rank) per ``config``.

    ``group``: the :class:`TPGroups` from :func:`paratrain.comm.tp.groups.build_tp_groups`, a
    bare :class:`TPComm` (pure TP), or ``None`` to build the groups now (collective).
    With data-parallel replicas, ``compressor`` compresses their gradient average and
    ``broadcast_buffers`` (DDP's) makes their buffers the first replica's every step.
    """
    cfg = config if isinstance(config, TensorParallelismConfig) else TensorParallelismConfig.model_validate(config)
    if group is None:
        try:
            group = build_tp_groups(
                cfg.tensor_parallel_size, pattern=cfg.communication_pattern.value,
                async_op=cfg.async_communication, fusion_threshold_bytes=cfg.fusion_threshold_bytes)
        except ValueError as e:
            raise ConfigError([("tensor_parallel.tensor_parallel_size", str(e))]) from None
    if isinstance(group, TPComm):
        group = TPGroups(group, None, group.size, 1, 0)
    return TensorParallelModule(model, cfg, group, compressor=compressor,
                                broadcast_buffers=broadcast_buffers)
