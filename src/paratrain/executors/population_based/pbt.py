"""Population-based training maths (Jaderberg et al. 2017, "Population Based Training of
Neural Networks", arXiv:1711.09846): pure, seeded, no I/O.

``[search_space]`` dimensions (:mod:`paratrain.config.job`), ``u ~ U[0, 1)``:
``uniform(low, high)``: ``low + u·(high − low)``; ``log_uniform(low, high)``:
``exp(log low + u·(log high − log low))``; ``int(low, high)``: uniform over ``[low, high]``
(inclusive); ``choice(values)``: one of ``values``, uniform.

After each generation member ``i`` scores ``s_i`` (higher is better, a failed member
``−inf``); exploit (§3) is **Truncation** (the bottom ``c`` copy a member drawn from the top
``c``, :func:`truncation_cutoff`) or **Binary** (:func:`exploit_binary`); explore (§4),
**Perturbation** (:func:`perturb_dim`) or **Resample** (:func:`sample_dim`), applies only to
members that copied, to the hyperparameters they received. Decisions use the scores and
states of the generation that just ended (a donor replaced this generation still gives what
it had); ties break by member index and every draw comes from the population's own
``torch.Generator``. :class:`PopulationState` is DESIGN §9's explicit state of rank 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...config import ConfigError
from ...config.job import ChoiceDim, IntDim, LogUniformDim, UniformDim
from ...config.strategy import Binary, Perturbation, Resample, Truncation

Dim = UniformDim | LogUniformDim | IntDim | ChoiceDim
Space = Mapping[str, Dim]


def uniform01(gen: torch.Generator) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def randint(n: int, gen: torch.Generator) -> int:
    return int(torch.randint(n, (), generator=gen))


def sample_dim(dim: Dim, gen: torch.Generator) -> Any:
    """One value of ``dim`` (the module docstring's distributions)."""
    if isinstance(dim, LogUniformDim):  # before UniformDim: it is a subclass
        lo, hi = math.log(dim.low), math.log(dim.high)
        return _clamp(math.exp(lo + uniform01(gen) * (hi - lo)), dim.low, dim.high)
    if isinstance(dim, UniformDim):
        return _clamp(dim.low + uniform01(gen) * (dim.high - dim.low), dim.low, dim.high)
    if isinstance(dim, IntDim):
        return dim.low + randint(dim.high - dim.low + 1, gen)
    return dim.values[randint(len(dim.values), gen)]


def sample_space(space: Space, gen: torch.Generator) -> dict[str, Any]:
    """One value per dimension, in sorted name order (so draws do not depend on dict order)."""
    return {name: sample_dim(space[name], gen) for name in sorted(space)}


def perturb_dim(dim: Dim, value: Any, factor: float, gen: torch.Generator) -> Any:
    """Jaderberg et al. perturbation of one value: ``clamp(value · (1 + (2u − 1)·factor),
    low, high)``, ``u ~ U[0,1)``; ``int`` dims are rounded half-up, and when ``factor > 0``
    and rounding gives the same integer back (``1 · 1.2`` rounds to 1) the value moves one
    unit instead, up when ``u ≥ 0.5``, then is clamped -- so every integer of a range stays
    reachable. ``choice``: index ``k`` moves to ``k ± 1`` with equal probability (the only
    neighbour at either end; a one-value list stays put); a value not in the list is redrawn.
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


_INTEGER = {"batch_size"}  # int dims or choices of integers
_POSITIVE = {"lr", "batch_size"}  # > 0 over the whole range


def validate_space(space: Space, *, known: Iterable[str], open_names: bool = False) -> None:
    """Reject an empty space, unknown names and impossible ranges (ConfigError). ``known``:
    the hyperparameters a member can carry; ``open_names``: any name (a ``**kwargs`` factory)."""
    problems: list[tuple[str, str]] = []
    if not space:
        problems.append(("search_space",
                         "empty: PopulationBased needs at least one hyperparameter to search"))
    known_set = set(known)
    for name in sorted(space):
        dim, path = space[name], f"search_space.{name}"
        if not open_names and name not in known_set:
            problems.append((path, f"unknown hyperparameter {name!r}; valid: "
                                   f"{', '.join(sorted(known_set))}"))
            continue
        if name in _INTEGER:
            ok = isinstance(dim, IntDim) or (
                isinstance(dim, ChoiceDim)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in dim.values)
            )
            if not ok:
                problems.append((path, f"{name} takes integers: use type 'int' or a choice of integers"))
                continue
        if name in _POSITIVE:
            values = dim.values if isinstance(dim, ChoiceDim) else [dim.low]
            bad = [v for v in values if not isinstance(v, int | float) or v <= 0]
            if bad:
                problems.append((path, f"{name} must be > 0 (got {bad[0]!r})"))
    if problems:
        raise ConfigError(problems)


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


_EPS = 1e-9


@dataclass(frozen=True)
class Copy:
    """One exploit event: ``recipient`` takes ``donor``'s state; ``hparams`` after explore."""

    recipient: int
    donor: int
    hparams_before: dict[str, Any]
    donor_hparams: dict[str, Any]
    hparams: dict[str, Any]


def score(value: float | None, mode: str = "max") -> float:
    """Fitness as a higher-is-better score; ``None``/NaN (failed member) is ``−inf``."""
    if value is None or math.isnan(value):
        return -math.inf
    if mode == "max":
        return float(value)
    if mode == "min":
        return -float(value)
    raise ValueError(f"mode must be 'max' or 'min' (got {mode!r})")


def best_of(fitness: Sequence[float | None], mode: str) -> int:
    """Index of the best fitness (lowest index on ties)."""
    return max(range(len(fitness)), key=lambda i: (score(fitness[i], mode), -i))


def truncation_cutoff(n: int, fraction: float) -> int:
    """``clamp(ceil(n·fraction), 1, ⌊n/2⌋)``; 0 when ``n < 2`` (nobody to copy from). A tiny
    tolerance keeps float error from bumping exact products (0.3·10) up by one."""
    if n < 2:
        return 0
    c = math.ceil(n * fraction - _EPS) if fraction == fraction else 1
    return max(1, min(c, n // 2))


def exploit_truncation(scores: Sequence[float], fraction: float,
                       gen: torch.Generator) -> list[tuple[int, int]]:
    """``(recipient, donor)`` pairs for Truncation, recipients worst-first."""
    n = len(scores)
    c = truncation_cutoff(n, fraction)
    if c == 0:
        return []
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    top, bottom = order[:c], order[n - c :][::-1]
    return [(r, top[randint(c, gen)]) for r in bottom]


def exploit_binary(scores: Sequence[float], threshold: float,
                   gen: torch.Generator) -> list[tuple[int, int]]:
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


def explore(hparams: dict[str, Any], space: Space, strategy: Perturbation | Resample,
            gen: torch.Generator, *, frozen: Iterable[str] = ()) -> dict[str, Any]:
    """New hyperparameters from ``hparams``; names in ``frozen`` are kept as they are. Names
    are visited in sorted order so the draws do not depend on dict order."""
    keep = set(frozen)
    out = dict(hparams)
    for name in sorted(space):
        if name in keep:
            continue
        if isinstance(strategy, Perturbation):
            out[name] = perturb_dim(space[name], hparams[name], strategy.factor, gen)
        else:
            out[name] = sample_dim(space[name], gen)
    return out


def evolve(hparams: Sequence[dict[str, Any]], scores: Sequence[float], *, space: Space,
           exploit_strategy: Truncation | Binary, explore_strategy: Perturbation | Resample,
           gen: torch.Generator, frozen: Iterable[str] = ()
           ) -> tuple[list[dict[str, Any]], list[int], list[Copy]]:
    """One exploit/explore step: ``(new_hparams, sources, copies)``; ``sources[i]`` is the
    member whose state (end of this generation) member ``i`` starts the next generation from
    (``i`` itself unless it copied), ``copies`` the exploit events in the order drawn."""
    frozen = tuple(frozen)
    new = [dict(h) for h in hparams]
    sources = list(range(len(hparams)))
    copies: list[Copy] = []
    if isinstance(exploit_strategy, Truncation):
        pairs = exploit_truncation(scores, exploit_strategy.fraction, gen)
    else:
        pairs = exploit_binary(scores, exploit_strategy.threshold, gen)
    for r, d in pairs:
        after = explore(hparams[d], space, explore_strategy, gen, frozen=frozen)
        copies.append(Copy(r, d, dict(hparams[r]), dict(hparams[d]), after))
        new[r] = after
        sources[r] = d
    return new, sources, copies


@dataclass
class PopulationState:
    """Rank 0's population: at generation ``generation`` member ``i`` starts from the
    end-of-previous-generation state of ``sources[i]`` (``None``: fresh) with ``hparams[i]``."""

    size: int
    seed: int
    generation: int = 0
    hparams: list[dict[str, Any]] = field(default_factory=list)
    sources: list[int | None] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    gen: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def initial(cls, space: Space, *, size: int, seed: int) -> PopulationState:
        """Draw ``size`` members from ``space`` with a generator seeded by ``seed``."""
        g = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
        hparams = [sample_space(space, g) for _ in range(size)]
        return cls(size=size, seed=seed, hparams=hparams, sources=[None] * size, gen=g)

    def advance(self, fitness: Sequence[float | None], *, mode: str, space: Space,
                exploit_strategy: Truncation | Binary, explore_strategy: Perturbation | Resample,
                evolve_now: bool = True, frozen: Iterable[str] = (),
                errors: Sequence[str | None] | None = None,
                metrics: Sequence[dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """Record generation ``self.generation`` and prepare the next; returns its record.
        Raises ``RuntimeError`` when every member failed (no fitness to evolve on)."""
        scores = [score(f, mode) for f in fitness]
        if all(s == float("-inf") for s in scores):
            first = next((e for e in (errors or []) if e), "no fitness reported")
            raise RuntimeError(f"generation {self.generation}: every member failed, so there is "
                               f"no fitness to evolve on (first failure: {first})")
        record: dict[str, Any] = {
            "generation": self.generation,
            "hparams": [dict(h) for h in self.hparams],
            "sources": list(self.sources),
            "fitness": [None if s == float("-inf") else f for s, f in zip(scores, fitness, strict=True)],
            "errors": list(errors) if errors is not None else [None] * self.size,
            "metrics": list(metrics) if metrics is not None else [None] * self.size,
            "copies": [],
        }
        if evolve_now:
            new, sources, copies = evolve(self.hparams, scores, space=space,
                                          exploit_strategy=exploit_strategy,
                                          explore_strategy=explore_strategy, gen=self.gen, frozen=frozen)
            record["copies"] = [asdict(c) for c in copies]
            self.hparams = new
            self.sources = list(sources)
        else:
            self.sources = list(range(self.size))
        self.history.append(record)
        self.generation += 1
        return record

    def best(self, mode: str = "max") -> int:
        """The best member of the last recorded generation (:func:`best_of`)."""
        return best_of(self.history[-1]["fitness"], mode)

    def state_dict(self) -> dict[str, Any]:
        doc = {"size": self.size, "seed": self.seed, "generation": self.generation,
               "hparams": self.hparams, "sources": self.sources, "history": self.history}
        # JSON text (exact round trip of floats and choice values) and the generator's byte
        # tensor: it loads with torch.load(weights_only=True)
        return {"json": json.dumps(doc), "generator": self.gen.get_state()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PopulationState:
        doc = json.loads(state["json"])
        gen = torch.Generator()
        gen.set_state(state["generator"])
        return cls(size=int(doc["size"]), seed=int(doc["seed"]), generation=int(doc["generation"]),
                   hparams=list(doc["hparams"]), sources=list(doc["sources"]),
                   history=list(doc["history"]), gen=gen)


def ancestry(history: Sequence[dict[str, Any]], member: int) -> list[dict[str, Any]]:
    """The schedule that produced ``member``'s final weights, oldest first: per generation
    the member slot that trained them, its hyperparameters and fitness (``sources`` walked back)."""
    out: list[dict[str, Any]] = []
    m: int | None = member
    for rec in reversed(history):
        assert m is not None
        out.append({
            "generation": rec["generation"], "member": m,
            "hparams": dict(rec["hparams"][m]), "fitness": rec["fitness"][m],
        })
        m = rec["sources"][m]
        if m is None:
            m = out[-1]["member"]
    out.reverse()
    return out


def lineage_json(state: PopulationState, *, metric: str, mode: str) -> dict[str, Any]:
    return {
        "population_size": state.size, "metric": metric, "mode": mode,
        "generations": state.history,
        "next": {"generation": state.generation, "hparams": state.hparams, "sources": state.sources},
    }
