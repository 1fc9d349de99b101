"""FedYogi (Reddi et al. 2021): ``v_t = v − (1 − β2)·Δ²·sign(v − Δ²)``.

Yogi's additive second moment grows or shrinks by at most ``(1 − β2)·Δ²`` per round,
which keeps the effective server learning rate from collapsing. See ``_adaptive``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._adaptive import AdaptiveServerOptimizer

__all__ = ["FedYogiAggregator"]


class FedYogiAggregator(AdaptiveServerOptimizer):
    name = "FedYogi"

    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        return v - (1.0 - self.beta2) * d2 * torch.sign(v - d2)
