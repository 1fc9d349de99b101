"""FedAdam (Reddi et al. 2021): ``v_t = β2·v + (1 − β2)·Δ²``. See ``_adaptive``."""

from __future__ import annotations

from torch import Tensor

from ._adaptive import AdaptiveServerOptimizer

__all__ = ["FedAdamAggregator"]


class FedAdamAggregator(AdaptiveServerOptimizer):
    name = "FedAdam"

    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        return self.beta2 * v + (1.0 - self.beta2) * d2
