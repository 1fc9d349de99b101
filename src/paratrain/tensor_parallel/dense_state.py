"""The dense model's view of a tensor-parallel model (a mixin of
:class:`~.module.TensorParallelModule`, which supplies ``module`` and ``comm``): whole tensors
gathered from the shards (a 2-D grid block along both grid dims) under the names the dense
model gave them (an encoder layer's q/k/v/o are ``self_attn.in_proj_*`` / ``out_proj.*``,
packed parts one dense tensor, :mod:`.shards`), as ``paratrain export`` writes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .grid import grid_steps
from .layers import ParallelEncoderLayer
from .shards import pack_dense, renames


class DenseState:
    """The dense state of a converted model."""

    module: nn.Module
    comm: Any

    def _mha_prefixes(self) -> list[str]:
        return [n + "." if n else "" for n, m in self.module.named_modules()
                if isinstance(m, ParallelEncoderLayer)]

    def to_dense_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename full (gathered) tensors to the dense model's keys: an encoder layer's
        q/k/v/o go back into ``self_attn.in_proj_*`` / ``self_attn.out_proj.*``."""
        out = dict(tensors)
        for pre in self._mha_prefixes():
            a = pre + "self_attn."
            for kind in ("weight", "bias"):
                parts = [out.pop(f"{a}{c}.{kind}", None) for c in "qkv"]
                if all(t is not None for t in parts):
                    out[f"{a}in_proj_{kind}"] = torch.cat(parts)  # type: ignore[arg-type]
                o = out.pop(f"{a}o.{kind}", None)
                if o is not None:
                    out[f"{a}out_proj.{kind}"] = o
        # an opted-in attention's q/k/v/o under the names its module gave them
        for local, (dense, index) in renames(self.module).items():
            if index is None and local != dense and local in out:
                out[dense] = out.pop(local)
        return pack_dense(self.module, out)

    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gather per-parameter shards (e.g. gradients, keyed like ``module``'s parameters)
        into full tensors under the dense model's names (collective over TP)."""
        params = dict(self.module.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            p = params.get(name)
            steps = grid_steps(p) if p is not None else None
            if steps is not None:
                for comm, dim, sizes in steps:
                    t = comm.all_gather(t.contiguous(), dim, sizes).wait()
            elif p is not None and hasattr(p, "tp_shard_dim") and self.comm.size > 1:
                t = self.comm.all_gather(t.contiguous(), p.tp_shard_dim, p.tp_sizes).wait()  # type: ignore[attr-defined]
            out[name] = t.detach().clone()
        return self.to_dense_names(out)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict with the dense model's keys (collective)."""
        tensors = {n: p.detach() for n, p in self.module.named_parameters()}
        tensors.update({n: b.detach() for n, b in persistent_buffers(self.module)})
        return self.gather_full(tensors)


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds: not those registered ``persistent=False`` (HF's
    rotary ``inv_freq``, recomputed from the config)."""
    out = []
    for prefix, m in module.named_modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out
