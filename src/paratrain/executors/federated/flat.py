"""A model state as the two flat vectors the federated round broadcasts.

``flatten_state`` concatenates the floating-point tensors (as float32) and, separately, the
integer ones (as int64, e.g. BatchNorm's ``num_batches_tracked``), in the state's key order;
``unflatten_state`` cuts them back into tensors shaped and typed like a template state.
"""

from __future__ import annotations

import torch

__all__ = ["flatten_state", "unflatten_state"]


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
