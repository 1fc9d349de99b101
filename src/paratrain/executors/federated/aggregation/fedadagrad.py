"""FedAdagrad (Reddi et al. 2021): ``v_t = v + Δ²``; no first-moment decay by default
(``β1 = 0``, so ``m_t = Δ_t``). See ``_adaptive``."""

from __future__ import annotations

from torch import Tensor

from ._adaptive import AdaptiveServerOptimizer

__all__ = ["FedAdagradAggregator"]


class FedAdagradAggregator(AdaptiveServerOptimizer):
    name = "FedAdagrad"
    spec_fields = ("eta", "tau")

    def __init__(self, *, eta: float, tau: float, beta1: float = 0.0) -> None:
        super().__init__(eta=eta, beta1=beta1, beta2=0.0, tau=tau)

    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        return v + d2
