"""A model's state without aliases: one entry per distinct tensor. A tied weight is two
``state_dict()`` names for one tensor; a federated update, an aggregate or a compressed
exchange must see it once, or the two names could get different values.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def _key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


def unique_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every alias of an earlier entry dropped."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=keep_vars).items():
        k = _key(t)
        if t.numel() and k in seen:
            continue
        seen.add(k)
        out[name] = t
    return out


@torch.no_grad()
def load_unique_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (as :func:`unique_state_dict` gives it) into ``model`` in place; a
    key set other than the model's unique one is a ``KeyError`` naming the differences."""
    own = unique_state_dict(model, keep_vars=True)
    if own.keys() != state.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise KeyError(f"state does not fit the model: missing {missing}, unexpected {extra}")
    for name, t in own.items():
        t.data.copy_(state[name])
