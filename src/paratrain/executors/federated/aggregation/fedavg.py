"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks
from Decentralized Data").

Server step: ``w ← w + Σ_i n_i Δ_i / Σ_i n_i`` with ``n_i`` the client's example
count, i.e. the example-weighted mean of the client models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import Aggregator, Update, check_weights

__all__ = ["fedavg_step", "FedAvgAggregator"]


def fedavg_step(updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
    """The example-weighted mean of the updates, per key, in float64.

    Accumulated update by update in the given order (one float64 buffer per key, no
    stacked copy), so memory stays flat in the number of clients.
    """
    n = len(updates)
    w = check_weights(weights, n)
    total = float(w.sum())
    out: dict[str, Tensor] = {}
    names = list(updates[0])
    flats = [_as_vector(u, names) for u in updates]
    if names and all(f is not None for f in flats):  # one add per update (the same sums)
        acc = torch.zeros(sum(updates[0][k].numel() for k in names), dtype=torch.float64)
        for f, wi in zip(flats, w.tolist(), strict=True):
            acc.add_(f, alpha=wi)  # type: ignore[arg-type]  # (none is None here)
        pos = 0
        for name in names:
            t = updates[0][name]
            out[name] = acc[pos : pos + t.numel()].reshape(t.shape) / total
            pos += t.numel()
        return out
    for name in names:
        acc = torch.zeros(updates[0][name].shape, dtype=torch.float64)
        for u, wi in zip(updates, w.tolist(), strict=True):
            acc.add_(u[name].detach(), alpha=wi)  # in float64: add_ promotes without a copy
        out[name] = acc / total
    return out


def _as_vector(update: Update, names: list[str]) -> Tensor | None:
    """``update``'s tensors (``names`` in order) as one vector without a copy, where they are
    consecutive contiguous views of one CPU buffer of one dtype (what the server's one-pass
    decoding gives); None otherwise. Each element is added as it would be tensor by tensor."""
    first = update[names[0]] if names and names[0] in update else None
    if first is None or first.device.type != "cpu" or len(update) != len(names):
        return None
    storage, pos = first.untyped_storage(), first.storage_offset()
    for name in names:
        t = update.get(name)
        if (t is None or t.dtype != first.dtype or not t.is_contiguous() or t.requires_grad
                or t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != pos):
            return None
        pos += t.numel()
    size = pos - first.storage_offset()
    return first.new_empty(0).set_(storage, first.storage_offset(), (size,), (1,))


class FedAvgAggregator(Aggregator):
    """Stateless FedAvg server."""

    name = "FedAvg"

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        return fedavg_step(updates, weights)
