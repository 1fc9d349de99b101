"""Exploit and explore: the evolutionary step of PBT as pure functions.

Jaderberg et al. 2017, "Population Based Training of Neural Networks"
(arXiv:1711.09846), §3-4. After each generation every member ``i`` has a score
``s_i`` (higher is better; a failed member scores ``−inf``):

- **Truncation{fraction}**: rank by score; ``c = clamp(ceil(n·fraction), 1, ⌊n/2⌋)``;
  each of the bottom ``c`` copies (weights, optimizer state, hyperparameters) a member
  drawn uniformly from the top ``c``. With ``n < 2`` nothing happens.
- **Binary{threshold}** (the paper's "binary tournament"): each member ``i`` draws
  another member ``j ≠ i`` uniformly and copies it when ``s_j − s_i > threshold``.
  Decisions use the scores and states of the generation that just ended, so a donor
  that is itself replaced this generation still gives what it had (its checkpoint).
- **Perturbation{factor}** / **Resample**: applied only to members that copied, to the
  hyperparameters they received (:func:`paratrain.executors.population_based.pbt.space.perturb_dim`,
  :func:`paratrain.executors.population_based.pbt.space.sample_dim`).

Ties in ranking break by member index (stable), so results depend only on the scores
and the generator state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ....config.strategy import Binary, Perturbation, Resample, Truncation
from .space import Space, perturb_dim, randint, sample_dim

__all__ = [
    "Copy",
    "score",
    "truncation_cutoff",
    "exploit_truncation",
    "exploit_binary",
    "exploit",
    "explore",
    "evolve",
]

_EPS = 1e-9


@dataclass(frozen=True)
class Copy:
    """One exploit event: ``recipient`` takes ``donor``'s state; ``hparams`` after explore."""

    recipient: int
    donor: int
    hparams_before: dict[str, Any]
    donor_hparams: dict[str, Any]
    hparams: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "recipient": self.recipient,
            "donor": self.donor,
            "hparams_before": dict(self.hparams_before),
            "donor_hparams": dict(self.donor_hparams),
            "hparams": dict(self.hparams),
        }


def score(value: float | None, mode: str = "max") -> float:
    """Fitness as a higher-is-better score; ``None``/NaN (failed member) is ``−inf``."""
    if value is None or math.isnan(value):
        return -math.inf
    if mode == "max":
        return float(value)
    if mode == "min":
        return -float(value)
    raise ValueError(f"mode must be 'max' or 'min' (got {mode!r})")


def truncation_cutoff(n: int, fraction: float) -> int:
    """``clamp(ceil(n·fraction), 1, ⌊n/2⌋)``; 0 when ``n < 2`` (nobody to copy from).

    A tiny tolerance keeps float error from bumping exact products (0.3·10) up by one.
    """
    if n < 2:
        return 0
    c = math.ceil(n * fraction - _EPS) if fraction == fraction else 1
    return max(1, min(c, n // 2))


def _ranking(scores: Sequence[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def exploit_truncation(
    scores: Sequence[float], fraction: float, gen: torch.Generator
) -> list[tuple[int, int]]:
    """``(recipient, donor)`` pairs for Truncation, recipients worst-first."""
    n = len(scores)
    c = truncation_cutoff(n, fraction)
    if c == 0:
        return []
    order = _ranking(scores)
    top, bottom = order[:c], order[n - c :][::-1]
    return [(r, top[randint(c, gen)]) for r in bottom]


def exploit_binary(
    scores: Sequence[float], threshold: float, gen: torch.Generator
) -> list[tuple[int, int]]:
    """``(recipient, donor)`` pairs for Binary: ``i`` copies random ``j ≠ i`` if ``s_j − s_i > threshold``."""
    n = len(scores)
    if n < 2:
        return []
    pairs: list[tuple[int, int]] = []
    for i in range(n):
        j = randint(n - 1, gen)
        j = j + 1 if j >= i else j
        gap = scores[j] - scores[i]  # nan when both are -inf: no copy
        if gap > threshold:
            pairs.append((i, j))
    return pairs


def exploit(
    scores: Sequence[float], strategy: Truncation | Binary, gen: torch.Generator
) -> list[tuple[int, int]]:
    if isinstance(strategy, Truncation):
        return exploit_truncation(scores, strategy.fraction, gen)
    if isinstance(strategy, Binary):
        return exploit_binary(scores, strategy.threshold, gen)
    raise TypeError(f"unknown exploit strategy {strategy!r}")


def explore(
    hparams: dict[str, Any],
    space: Space,
    strategy: Perturbation | Resample,
    gen: torch.Generator,
    *,
    frozen: Iterable[str] = (),
) -> dict[str, Any]:
    """New hyperparameters from ``hparams``; names in ``frozen`` are kept as they are.

    Names are visited in sorted order so the draws do not depend on dict order.
    """
    keep = set(frozen)
    out = dict(hparams)
    for name in sorted(space):
        if name in keep:
            continue
        dim = space[name]
        if isinstance(strategy, Perturbation):
            out[name] = perturb_dim(dim, hparams[name], strategy.factor, gen)
        elif isinstance(strategy, Resample):
            out[name] = sample_dim(dim, gen)
        else:
            raise TypeError(f"unknown explore strategy {strategy!r}")
    return out


def evolve(
    hparams: Sequence[dict[str, Any]],
    scores: Sequence[float],
    *,
    space: Space,
    exploit_strategy: Truncation | Binary,
    explore_strategy: Perturbation | Resample,
    gen: torch.Generator,
    frozen: Iterable[str] = (),
) -> tuple[list[dict[str, Any]], list[int], list[Copy]]:
    """One exploit/explore step.

    Returns ``(new_hparams, sources, copies)``: ``sources[i]`` is the member whose state
    (end of this generation) member ``i`` starts the next generation from (``i`` itself
    unless it copied), ``copies`` the exploit events in the order they were drawn.
    """
    if len(hparams) != len(scores):
        raise ValueError(f"{len(hparams)} members but {len(scores)} scores")
    frozen = tuple(frozen)
    new = [dict(h) for h in hparams]
    sources = list(range(len(hparams)))
    copies: list[Copy] = []
    for r, d in exploit(scores, exploit_strategy, gen):
        after = explore(hparams[d], space, explore_strategy, gen, frozen=frozen)
        copies.append(Copy(r, d, dict(hparams[r]), dict(hparams[d]), after))
        new[r] = after
        sources[r] = d
    return new, sources, copies
