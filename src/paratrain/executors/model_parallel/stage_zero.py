"""ZeRO inside a replicated pipeline stage (:class:`StageZero`; docs/model-parallel.md):
``shard = "optimizer" | "gradients" | "parameters"`` on a ``[subgraphs.<path>]``
DataParallel under ModelParallel makes each of the stage's ``R`` replicas step only its rows
of every parameter (dimension 0, :class:`~paratrain.comm.zero.FlatShard`, Rajbhandari et al.
2020). ZeRO-1 sums gradients with the one gradient sync and all-gathers the updated rows;
ZeRO-2 reduce-scatters the step's gradients after its last backward (not per micro-batch: a
pipeline's micro-batches accumulate into the whole gradients, which DeepSpeed refuses ZeRO-2
with pipelines over); ZeRO-3 also keeps only its rows between steps, gathering the whole
parameters once at the step's first forward and freeing them after the last reduce-scatter
(as torch pipelining does with an FSDP2 stage: gathering per use would cost ``2m`` gathers a
step). So the peak during a step is ZeRO-1's; ZeRO-2/3 save what is held between steps. The
update equals the unsharded stage's (element-wise optimizers); the checkpoint holds each
replica's rows under the model's names with their row specs (resumable on another world).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...comm import collectives as C
from ...comm.zero import FlatShard
from ...config import ConfigError
from ..shared.zero_shards import (
    ShardView,
    Unit,
    free_unit,
    gather_unit,
    held_bytes,
    keep_own_rows,
    shard_view,
)

STAGE_LEVELS = {"optimizer": 1, "gradients": 2, "parameters": 3}


def compose_spec(outer: dict[str, Any] | None, inner: dict[str, Any] | None) -> dict[str, Any] | None:
    """The spec of ``inner``'s piece of a tensor that is itself ``outer``'s piece of the model's
    tensor (slices compose as successive ``narrow``s, :mod:`paratrain.training.reshard`)."""
    if outer is None or inner is None:
        return outer if inner is None else inner
    return {"shape": list(outer["shape"]), "slices": [*outer["slices"], *inner["slices"]]}


class StageZero:
    """ZeRO-``level`` over ``group`` (the stage's replicas) for ``stage`` (module doc):
    :attr:`view` is what the optimizer steps and the checkpoint holds."""

    def __init__(self, stage: nn.Module, *, level: str, group: Any, where: str,
                 device: torch.device) -> None:
        self.level = STAGE_LEVELS[level]
        self.group, self.device = group, device
        self.world, rank = C.world_size(group), C.rank_of(group)
        # an empty parameter (a stage that owns none keeps an empty placeholder) has no rows
        named = [(k, p) for k, p in stage.named_parameters() if p.requires_grad and p.numel() > 0]
        flat0 = [k for k, p in named if p.dim() == 0]
        if flat0:
            raise ConfigError([(f"subgraphs.{where}.shard", (
                f"stage parameter {flat0[0]} is 0-dimensional: it has no rows to shard; make "
                "it shape [1] or leave shard = \"none\""))])
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for k, p in named:
            by_dtype.setdefault(p.dtype, []).append((k, p))
        self.units = [Unit(str(dt), ps, FlatShard([p.shape for _, p in ps], world=self.world, rank=rank))
                      for dt, ps in by_dtype.items()]
        self.view: ShardView = shard_view(stage, self.units)
        if not list(self.view.parameters()):  # no rows here: an optimizer still needs a parameter
            self.view.add("placeholder", nn.Parameter(torch.zeros(0, device=device)))
        self.params = [p for u in self.units for p in u.params]
        self._new_step = True
        if self.level == 3:
            for u in self.units:
                keep_own_rows(u, device)
            self.reshard()

    def pieces(self) -> Iterator[tuple[nn.Parameter, nn.Parameter, int]]:
        """``(piece, whole parameter, first row)`` of every row range this replica steps."""
        for u in self.units:
            for piece, p, fp in zip(u.pieces, u.params, u.flat.pieces, strict=True):
                if piece is not None:
                    yield piece, p, fp.start

    def begin(self, counter: C.CommCounter | None = None) -> None:
        """Before a step's first forward: last step's whole gradients dropped; ZeRO-3 gathers."""
        if self._new_step:
            self._new_step = False
            for p in self.params:
                p.grad = None
            for u in self.units:
                u.grad = None
            self.unshard(counter)

    def unshard(self, counter: C.CommCounter | None = None) -> None:
        """ZeRO-3: the replicas' rows all-gathered into the whole parameters (collective)."""
        for u in self.units:
            gather_unit(u, group=self.group, counter=counter)

    def reshard(self) -> None:
        """ZeRO-3: the whole parameters freed; this replica keeps its rows in ``u.shard``."""
        for u in self.units:
            free_unit(u)

    def sync(self, counter: C.CommCounter | None = None) -> None:
        """After the step's last backward (ZeRO-1: after the sum's all-reduce): each piece's
        ``grad`` is its rows of the replicas' summed gradient, None where no replica used
        the parameter this step."""
        self._new_step = True
        if self.level == 1:
            for piece, p, start in self.pieces():
                piece.grad = None if p.grad is None else p.grad.detach()[start : start + piece.shape[0]]
            return
        flags = [p.grad is not None for p in self.params]
        used = iter(C.used_mask(flags, group=self.group, counter=counter) if flags else [])
        for u in self.units:
            u.grad = torch.empty(u.flat.numel, dtype=u.params[0].dtype, device=self.device)
            u.flat.reduce_scatter([p.grad for p in u.params], u.grad, group=self.group,
                                  counter=counter, average=False)
            for i, (maybe, whole) in enumerate(zip(u.pieces, u.params, strict=True)):
                live = next(used)
                whole.grad = None  # the whole gradient is dropped: this replica keeps its rows
                if maybe is not None:
                    maybe.grad = u.flat.view(u.grad, i) if live else None
        self.reshard()  # ZeRO-3: the optimizer steps the rows only

    @torch.no_grad()
    def gather(self, counter: C.CommCounter | None = None) -> None:
        """ZeRO-1/2: every replica's rows all-gathered into the whole parameters (after each
        step and a resume); ZeRO-3 keeps its rows until the next :meth:`begin`."""
        if self.level == 3:
            return
        for u in self.units:
            flat = u.flat.pack_own(u.params, torch.empty(u.flat.numel, dtype=u.params[0].dtype,
                                                          device=self.device))
            u.flat.gather(flat, [p.data for p in u.params], group=self.group, counter=counter)

    def names(self, stage_names: dict[str, str]) -> dict[str, str]:
        """The view's keys -> the model's names (``stage_names``: the stage's keys -> them)."""
        return {k: stage_names.get(v, v) for k, v in self.view.names.items()}

    def shards(self, stage_shards: dict[str, Any]) -> dict[str, Any]:
        """The view's keys -> their specs: this replica's rows, after the stage key's own
        tensor-parallel spec where it has one."""
        out: dict[str, Any] = {}
        for k, v in self.view.names.items():
            spec = compose_spec(stage_shards.get(v), self.view.specs.get(k))
            if spec is not None:
                out[k] = spec
        return out

    def held_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this replica holds for the stage now (:func:`held_bytes`): the parameters
        (whole, or ZeRO-3's rows), the gradients (whole, or its rows), the optimizer state of
        its rows."""
        return held_bytes([*self.params, *(u.shard for u in self.units if u.shard is not None)],
                          optimizer, grads=[u.grad for u in self.units])

