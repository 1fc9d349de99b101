"""Search spaces for population-based training: sampling, perturbation, validation.

A search space maps a hyperparameter name to one of the ``[search_space]`` dimensions
of the job file (:mod:`paratrain.config.job`):

- ``uniform(low, high)``: ``x = low + u·(high − low)``, ``u ~ U[0, 1)``;
- ``log_uniform(low, high)``: ``x = exp(log low + u·(log high − log low))``;
- ``int(low, high)``: an integer in ``[low, high]`` (both inclusive), uniform;
- ``choice(values)``: one of ``values``, uniform.

Perturbation follows Jaderberg et al. 2017, "Population Based Training of Neural
Networks" (arXiv:1711.09846), §4: a numeric value is multiplied by a factor drawn
uniformly from ``[1 − f, 1 + f]`` and clamped to its range; an integer is rounded back
to an integer, and moves by at least one unit (up or down with the factor's sign) when
rounding would give the same integer back; a categorical value moves to a neighbouring
value in its list.

Every random draw comes from the ``torch.Generator`` passed in, so the same generator
state gives the same values (the population's own generator, see
:mod:`paratrain.executors.population_based.pbt.population`). Nothing here touches processes or files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ....config import ConfigError
from ....config.job import ChoiceDim, IntDim, LogUniformDim, UniformDim

__all__ = [
    "Dim",
    "Space",
    "uniform01",
    "randint",
    "sample_dim",
    "sample_space",
    "perturb_dim",
    "in_dim",
    "validate_space",
]

Dim = UniformDim | LogUniformDim | IntDim | ChoiceDim
Space = Mapping[str, Dim]


def uniform01(gen: torch.Generator) -> float:
    """One draw ``u ~ U[0, 1)`` from ``gen`` (float64)."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def randint(n: int, gen: torch.Generator) -> int:
    """One draw uniform over ``{0, ..., n-1}`` from ``gen``."""
    if n < 1:
        raise ValueError(f"randint needs n >= 1 (got {n})")
    return int(torch.randint(n, (), generator=gen))


def sample_dim(dim: Dim, gen: torch.Generator) -> Any:
    """Draw one value of ``dim`` (see the module docstring for the distributions)."""
    if isinstance(dim, LogUniformDim):  # before UniformDim: it is a subclass
        lo, hi = math.log(dim.low), math.log(dim.high)
        return _clamp(math.exp(lo + uniform01(gen) * (hi - lo)), dim.low, dim.high)
    if isinstance(dim, UniformDim):
        return _clamp(dim.low + uniform01(gen) * (dim.high - dim.low), dim.low, dim.high)
    if isinstance(dim, IntDim):
        return dim.low + randint(dim.high - dim.low + 1, gen)
    if isinstance(dim, ChoiceDim):
        return dim.values[randint(len(dim.values), gen)]
    raise TypeError(f"unknown search dimension {dim!r}")


def sample_space(space: Space, gen: torch.Generator) -> dict[str, Any]:
    """One value per dimension, in sorted name order (so draws do not depend on dict order)."""
    return {name: sample_dim(space[name], gen) for name in sorted(space)}


def perturb_dim(dim: Dim, value: Any, factor: float, gen: torch.Generator) -> Any:
    """Jaderberg et al. perturbation of one value.

    Numeric: ``clamp(value · (1 + (2u − 1)·factor), low, high)`` with ``u ~ U[0,1)``;
    ``int`` dims are rounded half-up and stay ``int``; when ``factor > 0`` and rounding
    gives back the same integer (small values: ``1 · 1.2`` rounds to 1), the value
    moves by one unit instead, up when ``u ≥ 0.5`` and down otherwise, then is
    clamped — so every integer of a range stays reachable. Same single draw as for
    floats, whose behaviour is unchanged; ``factor = 0`` leaves every value put. ``choice``: index ``k`` moves to
    ``k − 1`` or ``k + 1`` with equal probability (the only neighbour at either end; a
    one-value list stays put). A value not in the choice list is redrawn.
    """
    if isinstance(dim, ChoiceDim):
        n = len(dim.values)
        try:
            k = dim.values.index(value)
        except ValueError:
            return sample_dim(dim, gen)
        if n == 1:
            return dim.values[0]
        if k == 0:
            return dim.values[1]
        if k == n - 1:
            return dim.values[n - 2]
        return dim.values[k - 1 if randint(2, gen) == 0 else k + 1]
    u = uniform01(gen)
    scale = 1.0 + (2.0 * u - 1.0) * factor
    if isinstance(dim, IntDim):
        moved = math.floor(float(value) * scale + 0.5)
        if factor > 0.0 and moved == value:
            # value·factor < 0.5 (1, 2 with f = 0.2): rounding would undo every
            # perturbation; step one unit in the direction the factor was drawn.
            moved = int(value) + (1 if u >= 0.5 else -1)
        return int(_clamp(moved, dim.low, dim.high))
    return _clamp(float(value) * scale, dim.low, dim.high)


def in_dim(dim: Dim, value: Any) -> bool:
    """Whether ``value`` lies in ``dim`` (right type and inside the closed range)."""
    if isinstance(dim, ChoiceDim):
        return value in dim.values
    if isinstance(dim, IntDim):
        return isinstance(value, int) and not isinstance(value, bool) and dim.low <= value <= dim.high
    return isinstance(value, float) and dim.low <= value <= dim.high


def validate_space(
    space: Space,
    *,
    known: Iterable[str],
    integer_names: Iterable[str] = ("batch_size",),
    positive_names: Iterable[str] = ("lr", "batch_size"),
    open_names: bool = False,
) -> None:
    """Reject an empty space, unknown names and impossible ranges (ConfigError).

    ``known`` lists the hyperparameters a member can carry; ``open_names`` accepts any
    name (a factory that takes ``**kwargs``). Names in ``integer_names`` must be ``int``
    dims or choices of integers; names in ``positive_names`` must stay > 0.
    """
    problems: list[tuple[str, str]] = []
    if not space:
        problems.append(
            ("search_space", "empty: PopulationBased needs at least one hyperparameter to search")
        )
    known_set = set(known)
    ints, positive = set(integer_names), set(positive_names)
    for name in sorted(space):
        dim, path = space[name], f"search_space.{name}"
        if not open_names and name not in known_set:
            problems.append(
                (path, f"unknown hyperparameter {name!r}; valid: {', '.join(sorted(known_set))}")
            )
            continue
        if name in ints:
            ok = isinstance(dim, IntDim) or (
                isinstance(dim, ChoiceDim)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in dim.values)
            )
            if not ok:
                problems.append((path, f"{name} takes integers: use type 'int' or a choice of integers"))
                continue
        if name in positive:
            values = dim.values if isinstance(dim, ChoiceDim) else [dim.low]
            bad = [v for v in values if not isinstance(v, int | float) or v <= 0]
            if bad:
                problems.append((path, f"{name} must be > 0 (got {bad[0]!r})"))
    if problems:
        raise ConfigError(problems)


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)
