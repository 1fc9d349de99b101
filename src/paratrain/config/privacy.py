"""``[federated.dp]``: client-level differential privacy for the Federated strategy
(DP-FedAvg, McMahan et al. 2018; adaptive clipping, Andrew et al. 2021). The mechanism
and its accounting are :mod:`paratrain.executors.federated.privacy`."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ._base import PositiveCount, Section

Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class FederatedDP(Section):
    clip: Annotated[float, Field(gt=0.0)] | None
    """L2 norm every client update is clipped to (the whole update, all floating tensors
    together); ``inf`` (TOML) or null (JSON) = no clipping, allowed only with
    noise_multiplier = 0. With adaptive clipping (target_quantile) the initial clip."""
    noise_multiplier: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    """z: Gaussian noise of standard deviation z * clip on the (weighted) sum of the clipped
    updates (central) or on each clipped update (local); 0 = no noise and no guarantee."""
    mode: Literal["central", "local"] = "central"
    """``central``: the server clips each update, sums, adds the noise once and divides by
    the expected total weight; ``local``: each client clips and noises its own update."""
    delta: Annotated[float, Field(gt=0.0, lt=1.0)] = 1e-5
    """The delta of the (epsilon, delta) guarantee the accountant reports."""
    target_epsilon: Positive | None = None
    """Stop the run before a round that would spend more than this epsilon; None = run
    every round (epsilon is still reported)."""
    weight_cap: PositiveCount = 1
    """Central mode: client k weighs ``min(n_k, weight_cap)`` examples (McMahan et al.'s
    ``w_k = min(n_k / w_hat, 1)`` with ``w_hat = weight_cap``): 1 = uniform weights (the sum
    divided by the expected number of clients); at least the largest client's example
    count = FedAvg's example weighting (the noise grows with it: z * clip * weight_cap)."""
    target_quantile: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    """Adaptive clipping (central mode): the fraction of updates that should fall under
    the clip; the clip follows it geometrically. None = a fixed clip."""
    clip_learning_rate: Positive = 0.2
    """Adaptive clipping: eta in ``clip <- clip * exp(-eta * (b - target_quantile))``,
    ``b`` the noised fraction of unclipped updates."""
    clipped_count_stddev: Positive | None = None
    """Adaptive clipping: the standard deviation of the noise on the count of unclipped
    updates; None = the expected number of clients per round / 20 (Andrew et al.)."""

    @field_validator("clip", mode="before")
    @classmethod
    def _inf_is_none(cls, v: object) -> object:
        if isinstance(v, float) and math.isinf(v) and v > 0:
            return None
        if isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
            return None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> FederatedDP:
        if self.clip is None and self.noise_multiplier > 0:
            raise ValueError("clip = inf (no clipping) bounds no update, so noise_multiplier "
                             f"= {self.noise_multiplier} would give no guarantee: set a finite clip")
        if self.target_quantile is None:
            # by value, not by presence: a dumped job (JSON) carries every field
            defaults = type(self).model_fields
            unread = [f for f in ("clip_learning_rate", "clipped_count_stddev")
                      if getattr(self, f) != defaults[f].default]
            if unread:
                raise ValueError(f"{', '.join(unread)} tune adaptive clipping, which is off: set "
                                 "target_quantile too (or remove them)")
        if self.mode == "local" and self.weight_cap != 1:
            raise ValueError("weight_cap weighs the server's noised sum (central mode); in local mode "
                             "the job's aggregator weighs the noised updates by example count")
        if self.target_quantile is not None:
            if self.mode == "local":
                raise ValueError("adaptive clipping (target_quantile) needs the server's noised "
                                 "count of unclipped updates: use mode = \"central\"")
            if self.clip is None:
                raise ValueError("adaptive clipping (target_quantile) needs a finite initial clip")
        return self
