"""Privacy spent, round by round: a state object over Opacus's RDP accountant.

Each round is one sampled Gaussian mechanism of noise multiplier ``z`` and sampling rate
``q`` (Mironov 2017, "Renyi Differential Privacy"; Mironov, Talwar, Zhang 2019, "Renyi
Differential Privacy of the Sampled Gaussian Mechanism"): the RDP of the rounds adds up
over the orders ``alpha`` of :class:`opacus.accountants.RDPAccountant` and converts to the
smallest ``epsilon`` for the configured ``delta``. ``z = 0`` releases the updates
unnoised: ``epsilon = inf``.

The analysis assumes Poisson sampling of the clients at rate ``q``; paratrain's
``Random`` selection draws exactly ``k = q N`` clients without replacement, the same
approximation DP-FedAvg's implementations make (McMahan et al. 2018 account their
fixed-size samples this way too).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any


@functools.lru_cache(maxsize=64)
def _rdp_one_round(z: float, q: float) -> Any:
    """Opacus's RDP of one round at every default order (``compute_rdp`` with one step; its
    series for fractional orders is slow, so it is computed once per ``(z, q)``)."""
    from opacus.accountants import RDPAccountant  # imported only by DP jobs (slow import)
    from opacus.accountants.analysis import rdp as analysis

    rdp = analysis.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)
    rdp.setflags(write=False)
    return rdp


def rdp_epsilon(history: Sequence[Sequence[float]], delta: float) -> float:
    """``epsilon`` at ``delta`` after the rounds ``history`` = ``[(z, q, rounds), ...]``:
    ``RDPAccountant.get_epsilon``'s computation (the RDP of ``n`` rounds is ``n`` times one
    round's, summed over the history, converted by Opacus's ``get_privacy_spent``), with one
    round's RDP cached; 0 for no rounds, inf when a round had no noise."""
    if not history:
        return 0.0
    if any(float(z) == 0.0 for z, _, _ in history):
        return float("inf")
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    rdp = sum([_rdp_one_round(float(z), float(q)) * int(n) for z, q, n in history])
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound holds
        warnings.simplefilter("ignore")
        eps, _ = analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


def last_round_within(noise_multiplier: float, sample_rate: float, delta: float, target: float,
                      max_rounds: int) -> int:
    """The most rounds (``<= max_rounds``) at ``(z, q)`` whose epsilon stays ``<= target``
    (bisection: epsilon grows with the rounds)."""
    lo, hi = 0, int(max_rounds)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rdp_epsilon([(noise_multiplier, sample_rate, mid)], delta) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrivacyAccountant:
    """The rounds spent so far as Opacus's ``history`` of ``(z, q, rounds)`` runs."""

    def __init__(self, delta: float) -> None:
        self.delta = float(delta)
        self.history: list[tuple[float, float, int]] = []

    @property
    def rounds(self) -> int:
        return sum(n for _, _, n in self.history)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        """Book one round (merged into the last run when ``(z, q)`` repeat, as Opacus)."""
        z, q = float(noise_multiplier), float(sample_rate)
        if self.history and self.history[-1][:2] == (z, q):
            self.history[-1] = (z, q, self.history[-1][2] + 1)
        else:
            self.history.append((z, q, 1))

    def epsilon(self) -> float:
        return rdp_epsilon(self.history, self.delta)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> float:
        """The epsilon after ``rounds`` more rounds at ``(z, q)`` (nothing is booked)."""
        extra = [(float(noise_multiplier), float(sample_rate), int(rounds))] if rounds > 0 else []
        return rdp_epsilon([*self.history, *extra], self.delta)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[z, q, n] for z, q, n in self.history], "delta": self.delta}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The rounds of ``state``; epsilon is recomputed at this job's delta."""
        self.history = [(float(z), float(q), int(n)) for z, q, n in state["history"]]
