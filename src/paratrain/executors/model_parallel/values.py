"""Small pieces of the ModelParallel runtime: message slots, step statistics, the saved-
tensor meter, and the helpers that turn a part's values into what travels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .schedule import Action

__all__ = [
    "StepStats", "LossFn", "SavedBytes", "slot_of", "as_tuple", "check_tensor", "cross_entropy",
    "fill_output", "detached_leaf", "unpack_saved",
]

#: Message slot of transfer ``t`` between sender replica ``j`` and receiver replica ``k``.
_SLOTS = 64


def slot_of(t: int, j: int = 0, k: int = 0) -> int:
    return t * _SLOTS + j * 8 + k



@dataclass
class StepStats:
    """What one call ran: its wall time, compute time and activation peak."""

    step_s: float = 0.0
    compute_s: float = 0.0
    peak_activation_bytes: int = 0
    trace: list[tuple[str, int, int, float, float]] = field(default_factory=list)

    @property
    def order(self) -> list[Action]:
        return [(k, i, s) for k, i, s, _, _ in self.trace]  # type: ignore[misc]


class SavedBytes:
    """Counts distinct non-parameter storages saved for backward (a pack hook)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in self.exclude:
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return t


def unpack_saved(t: torch.Tensor) -> torch.Tensor:
    return t


#: ``loss_fn(output, batch) -> scalar``: the mean loss of a (micro-)batch (a Task's ``loss``).
LossFn = Callable[[Any, Sequence[torch.Tensor]], torch.Tensor]


def cross_entropy(out: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def as_tuple(out: Any, n: int) -> tuple[Any, ...]:
    return tuple(out) if n > 1 else (out,)


def detached_leaf(t: Any) -> Any:
    """A detached copy that records its own gradient (floating tensors only)."""
    if isinstance(t, torch.Tensor):
        d = t.detach()
        if d.is_floating_point():
            d.requires_grad_(True)
        return d
    return t


def fill_output(structure: Any, env: dict[str, Any]) -> Any:
    """The model's output structure with each value name replaced by its value."""
    return fx.node.map_aggregate(structure, lambda a: env[a] if isinstance(a, str) and a in env else a)


def check_tensor(value: str, val: Any, dst: int) -> None:
    if not isinstance(val, torch.Tensor):
        raise TypeError(
            f"model-parallel value {value!r} ({type(val).__name__}) is read on rank {dst} but "
            f"is not a tensor; only tensors travel between workers: place the nodes that make "
            f"and read it on one worker")
