"""``{"method":"RandomK","k":k}``: keep ``min(k, n)`` uniformly random positions.

C(x)_i = x_i for i in S, else 0, where S is a uniform random k-subset of {0..n-1} drawn
from a generator seeded by ``derive_seed(seed, step, key)``. Every rank computes the same
S for the same (seed, step, key), so only the k values travel (Stich et al., "Sparsified
SGD with memory", NeurIPS 2018) and ranks can all-reduce them directly. Values are not
rescaled by n/k (the Rust reference does not rescale either); E[C(x)] = (k/n) x, and
ErrorFeedback removes that bias over time.

The subset is drawn with numpy's ``Generator.choice(n, k, replace=False)`` on a PCG64
stream seeded by that value (Floyd's algorithm with a hash set when k << n, a partial
shuffle otherwise: both uniform k-subsets), on the CPU, so every rank and every device
type draws the same positions.
"""

from __future__ import annotations

from typing import Any

import torch

from ._kernels import randomk_positions
from .base import CompressedTensor, EncodeContext

__all__ = ["RandomKCodec", "randomk_positions"]


class RandomKCodec:
    """Keep k positions drawn from (seed, step, key); indices never travel."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"RandomK.k must be >= 0, got {k}")
        self.k = k

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        seed = ctx.derived_seed("RandomK")
        idx = randomk_positions(flat.numel(), self.k, seed).to(flat.device)
        return CompressedTensor(
            "RandomK", shape, flat.dtype, flat[idx], idx, seed=seed, k=int(idx.numel())
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
