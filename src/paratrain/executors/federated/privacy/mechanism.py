"""The Gaussian mechanism of DP-FedAvg as pure functions on client updates, and its accounting.

McMahan, Ramage, Talwar, Zhang 2018 (Algorithm 1, fixed-denominator estimator): each update
``D_k`` is clipped over all its floating tensors, ``clip(D, S) = D * min(1, S / ||D||)``; the
server adds ``N(0, (z S)^2 I)`` to ``sum_k w_k clip(D_k, S)`` (``w_k <= 1``) and divides by the
*expected* total weight ``q W``, never the realised one (which depends on who took part).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021): with ``b_k = 1[||D_k|| <= S]``
and ``b = (sum_k b_k + N(0, sigma_b^2)) / (q N)``, ``S <- S * exp(-eta (b - gamma))`` follows
the ``gamma`` quantile of the norms. The count costs privacy too: updates noised at ``z_D``
with ``z^-2 = z_D^-2 + (2 sigma_b)^-2`` make a round of multiplier ``z`` (their Theorem 1).

Accounting (:class:`PrivacyAccountant`, Opacus's RDP accountant; Mironov 2017, Mironov,
Talwar, Zhang 2019): each round is one sampled Gaussian mechanism ``(z, q)``; the RDP adds
up over the orders and converts to the smallest ``epsilon`` at ``delta`` (``z = 0``: inf).
Poisson sampling is assumed while ``Random`` draws exactly ``q N`` clients, the approximation
DP-FedAvg's implementations make. Every draw comes from :func:`dp_generator` seeded by
``(seed, round[, client])``, so a resumed run draws the same noise.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def dp_generator(seed: int, round_idx: int, client: int | None = None, salt: str = "dp",
                 generator: torch.Generator | None = None) -> torch.Generator:
    """A CPU generator determined by ``(salt, seed, round[, client])`` (blake2b, stable
    everywhere): ``generator`` reseeded (a new one when None)."""
    tag = f"{salt}|{seed}|{round_idx}" + ("" if client is None else f"|{client}")
    h = hashlib.blake2b(tag.encode(), digest_size=8).digest()
    g = generator if generator is not None else torch.Generator()
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g


def update_norm(update: Mapping[str, Tensor]) -> float:
    """``||D||_2`` over every tensor of the update together (in float64)."""
    return math.sqrt(sum(float(t.detach().to(torch.float64).square().sum()) for t in update.values()))


def clip_update(update: Mapping[str, Tensor], clip: float | None) -> tuple[dict[str, Tensor], float]:
    """``(D * min(1, clip / ||D||), ||D||)``; the same tensors when nothing is clipped."""
    norm = update_norm(update)
    if clip is None or math.isinf(clip) or norm <= clip:
        return dict(update), norm
    factor = clip / norm
    return {k: (v * factor).to(v.dtype) for k, v in update.items()}, norm


def add_noise(total: Mapping[str, Tensor], std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """``total + N(0, std^2 I)``, float64 draws key by key in sorted order, cast back."""
    out = dict(total)
    if std == 0.0:
        return out
    for k in sorted(total):
        t = total[k]
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * float(std)
        out[k] = (t.to(torch.float64) + noise).to(t.dtype)
    return out


def adaptive_clip(clip: float, unclipped: int, expected_clients: float, *, target_quantile: float,
                  learning_rate: float, count_stddev: float,
                  generator: torch.Generator) -> tuple[float, float]:
    """Andrew et al.'s geometric update: ``(S * exp(-eta (b - gamma)), b)`` with
    ``b = (unclipped + N(0, count_stddev^2)) / expected_clients``."""
    noise = float(torch.randn((), generator=generator, dtype=torch.float64)) * count_stddev
    b = (unclipped + noise) / expected_clients
    return clip * math.exp(-learning_rate * (b - target_quantile)), b


def update_noise_multiplier(z: float, count_stddev: float | None) -> float:
    """``z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (``z`` without adaptive clipping); a ValueError
    when ``2 sigma_b <= z``."""
    if count_stddev is None or z == 0.0:
        return z
    if 2.0 * count_stddev <= z:
        raise ValueError(f"clipped_count_stddev {count_stddev} must exceed noise_multiplier / 2 "
                         f"= {z / 2}: the count's noise alone would use the whole budget")
    return (z ** -2 - (2.0 * count_stddev) ** -2) ** -0.5


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
    """``epsilon`` at ``delta`` after ``history = [(z, q, rounds), ...]``, computed as
    ``RDPAccountant.get_epsilon`` with one round's RDP cached; inf when a round had no noise."""
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
