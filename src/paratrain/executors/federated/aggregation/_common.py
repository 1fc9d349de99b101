"""What the federated aggregators share: the :class:`Aggregator` base and the tensor helpers.
An update maps ``name -> tensor``, a client's ``D_i = w_i - w_global``; arithmetic is in
float64, cast back to the global tensor's dtype (the result depends only on client order).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

Update = Mapping[str, Tensor]


class MalformedUpdateError(ValueError):
    """A client update whose keys or shapes do not match the global model (naming both)."""

    def __init__(self, client: str, tensor: str, message: str) -> None:
        self.client = client
        self.tensor = tensor
        super().__init__(f"client {client}: tensor {tensor!r}: {message}")


class Aggregator(ABC):
    """A server aggregator: ``aggregate`` applies the method's :meth:`step` (``weights[i]``:
    client i's example count); ``aggregate_round`` also takes each client's ``{"steps",
    "norm", "control"}`` (SCAFFOLD, FedNova); ``state_dict`` holds the server state."""

    name: ClassVar[str]
    #: the contract's fields (``config.federated_aggregation``, which checks their ranges) the constructor takes
    spec_fields: ClassVar[tuple[str, ...]] = ()
    #: each client's uplink carries its control delta dc_i (SCAFFOLD; the server decodes it)
    sends_control: ClassVar[bool] = False

    @classmethod
    def from_spec(cls, spec: Any, *, num_clients: int | None = None) -> Aggregator:
        """The aggregator for contract value ``spec`` (``num_clients``: the job's N)."""
        return cls(**{f: getattr(spec, f) for f in cls.spec_fields})

    @abstractmethod
    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        """The server step ``Δ`` (float64 by tensor name) from the round's client deltas."""

    def aggregate(self, global_state: Mapping[str, Tensor], updates: Sequence[Update],
                  weights: Sequence[float]) -> dict[str, Tensor]:
        return apply_step(global_state, self.step(updates, weights))

    def aggregate_round(self, global_state: Mapping[str, Tensor], updates: Sequence[Update],
                        weights: Sequence[float], infos: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        return self.aggregate(global_state, updates, weights)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


class FlatUpdate(Mapping[str, Tensor]):
    """An update whose tensors are consecutive slices of one vector ``flat``, cut by
    ``layout`` (name -> ``(start, stop, shape)``, in order): the server's decoding of a dense
    payload. A tensor is a view made when read; FedAvg adds ``flat`` itself, one add per
    client, with no per-tensor view (at 1,000 clients a round those views cost more than
    the sums)."""

    __slots__ = ("flat", "layout")

    def __init__(self, flat: Tensor, layout: Mapping[str, tuple[int, int, tuple[int, ...]]]) -> None:
        self.flat, self.layout = flat, layout

    def __getitem__(self, name: str) -> Tensor:
        a, b, shape = self.layout[name]
        return self.flat[a:b].view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


def update_names(updates: Sequence[Update]) -> list[str]:
    """The tensor names of the round's updates (the first one's); a ValueError for none."""
    if not updates:
        raise ValueError("aggregating zero client updates")
    return list(updates[0])


def check_weights(weights: Sequence[float], n: int) -> Tensor:
    """Weights as a float64 vector: finite, >= 0, with a positive sum."""
    if len(weights) != n:
        raise ValueError(f"{n} updates but {len(weights)} weights")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if n == 0:
        raise ValueError("aggregating zero client updates")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"weights must be finite and >= 0 (got {list(weights)})")
    if float(w.sum()) <= 0.0:
        raise ValueError(f"weights sum to zero (got {list(weights)})")
    return w


def stack_key(updates: Sequence[Update], name: str) -> Tensor:
    """``U[i] = updates[i][name]`` as one float64 tensor of shape ``(n, *shape)``."""
    return torch.stack([u[name].detach().to(torch.float64) for u in updates])


def linear_combination(states: Sequence[Mapping[str, Tensor]], coefs: Sequence[float]) -> dict[str, Tensor]:
    """``sum_i coefs[i] states[i][k]`` per key, accumulated in float64 in order (no stacked copy)."""
    out: dict[str, Tensor] = {}
    for name, first in states[0].items():
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for s, ci in zip(states, coefs, strict=True):
            acc.add_(s[name].detach().to(torch.float64), alpha=float(ci))
        out[name] = acc
    return out


def apply_step(global_state: Mapping[str, Tensor], step: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``w_global[k] + step[k]`` in each global tensor's dtype (integer buffers rounded)."""
    out: dict[str, Tensor] = {}
    for name, g in global_state.items():
        new = g.detach().to(torch.float64) + step[name]
        if not g.is_floating_point():
            new = torch.round(new)
        out[name] = new.to(g.dtype)
    return out
