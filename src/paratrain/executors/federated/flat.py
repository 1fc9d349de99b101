"""A model state as the two flat vectors the federated round broadcasts.

``flatten_state`` concatenates the floating-point tensors (as float32) and, separately, the
integer ones (as int64, e.g. BatchNorm's ``num_batches_tracked``), in the state's key order;
``unflatten_state`` cuts them back into tensors shaped and typed like a template state;
``broadcast_state`` sends rank 0's state to every rank that way.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm.federated_ops import broadcast_

__all__ = ["flatten_state", "unflatten_state", "broadcast_state"]


def flatten_state(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    fl = [t.reshape(-1).to(torch.float32) for t in state.values() if t.is_floating_point()]
    it = [t.reshape(-1).to(torch.int64) for t in state.values() if not t.is_floating_point()]
    f = torch.cat(fl) if fl else torch.zeros(0)
    i = torch.cat(it) if it else torch.zeros(0, dtype=torch.int64)
    return f.contiguous(), i.contiguous()


def unflatten_state(template: dict[str, torch.Tensor], f: torch.Tensor, i: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    pf = pi = 0
    for k, t in template.items():
        n = t.numel()
        if t.is_floating_point():
            out[k] = f[pf : pf + n].reshape(t.shape).to(t.dtype).clone()
            pf += n
        else:
            out[k] = i[pi : pi + n].reshape(t.shape).to(t.dtype).clone()
            pi += n
    return out


def broadcast_state(state: dict[str, torch.Tensor], template: dict[str, torch.Tensor], *,
                    device: torch.device, group: Any, counter: Any = None) -> dict[str, torch.Tensor]:
    """Rank 0's ``state`` on every rank (the others pass anything keyed like ``template``, e.g.
    ``template`` itself), cut like ``template``, moved through ``device`` (NCCL moves only
    device tensors); ``counter`` books the bytes."""
    fvec, ivec = flatten_state(state)
    fvec, ivec = fvec.to(device), ivec.to(device)
    broadcast_(fvec, src=0, group=group, counter=counter)
    if ivec.numel():
        broadcast_(ivec, src=0, group=group, counter=counter)
    return unflatten_state(template, fvec.cpu(), ivec.cpu())
