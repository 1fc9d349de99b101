"""The Gaussian mechanism of DP-FedAvg as pure functions on client updates.

McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private Recurrent Language
Models" (Algorithm 1, fixed-denominator estimator): each update ``D_k`` is clipped to L2
norm ``S`` over all its floating tensors together,

    clip(D, S) = D * min(1, S / ||D||),

the server forms ``sum_k w_k clip(D_k, S)`` (``w_k <= 1``, so one client changes the sum by
at most ``S`` in L2), adds ``N(0, (z S)^2 I)`` and divides by the *expected* total weight
``q W`` (``q`` the sampling rate, ``W = sum over all clients of w_k``), never by the
realised one (which would depend on who took part).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private
Learning with Adaptive Clipping"): with ``b_k = 1[||D_k|| <= S]`` and the noised fraction
``b = (sum_k b_k + N(0, sigma_b^2)) / (q N)``, the clip follows the ``gamma`` quantile of
the update norms geometrically, ``S <- S * exp(-eta (b - gamma))``. Releasing the count
costs privacy too: with the updates noised at multiplier ``z_D`` the round is a Gaussian
mechanism of multiplier ``z`` where ``z^-2 = z_D^-2 + (2 sigma_b)^-2`` (their Theorem 1),
so :func:`update_noise_multiplier` gives the ``z_D`` that keeps the configured ``z``.

Every draw comes from :func:`dp_generator` seeded by ``(seed, round[, client])``, so a
resumed run draws the same noise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from torch import Tensor


def dp_generator(seed: int, round_idx: int, client: int | None = None, salt: str = "dp") -> torch.Generator:
    """A CPU generator determined by ``(salt, seed, round[, client])`` (blake2b)."""
    tag = f"{salt}|{seed}|{round_idx}" + ("" if client is None else f"|{client}")
    h = hashlib.blake2b(tag.encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g


def update_norm(update: Mapping[str, Tensor]) -> float:
    """``||D||_2`` over every tensor of the update together (in float64)."""
    sq = 0.0
    for t in update.values():
        sq += float(t.detach().to(torch.float64).square().sum())
    return math.sqrt(sq)


def clip_update(update: Mapping[str, Tensor], clip: float | None) -> tuple[dict[str, Tensor], float]:
    """``(D * min(1, clip / ||D||), ||D||)``; ``clip`` None or inf, or ``||D|| <= clip``,
    returns the tensors unchanged (the same objects: no rounding)."""
    norm = update_norm(update)
    if clip is None or math.isinf(clip) or norm <= clip:
        return dict(update), norm
    factor = clip / norm
    return {k: (v * factor).to(v.dtype) for k, v in update.items()}, norm


def add_noise(total: Mapping[str, Tensor], std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """``total + N(0, std^2 I)``, drawn key by key in sorted order from ``generator``
    (float64 draws, cast to each tensor's dtype); ``std = 0`` returns ``total`` as is."""
    if std == 0.0:
        return dict(total)
    out = dict(total)
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
    """``z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the updates' noise multiplier that makes a
    round with adaptive clipping a Gaussian mechanism of multiplier ``z`` (``z`` itself
    without adaptive clipping, ``count_stddev`` None). A ValueError when ``2 sigma_b <= z``
    (the count alone would spend the whole budget)."""
    if count_stddev is None or z == 0.0:
        return z
    if 2.0 * count_stddev <= z:
        raise ValueError(f"clipped_count_stddev {count_stddev} must exceed noise_multiplier / 2 "
                         f"= {z / 2}: the count's noise alone would use the whole budget")
    return (z ** -2 - (2.0 * count_stddev) ** -2) ** -0.5
