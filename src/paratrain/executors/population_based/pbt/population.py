"""The population's state: hyperparameters, sources, history (lineage), generator.

:class:`PopulationState` is the small explicit state object of DESIGN §9: everything
rank 0 needs to decide the next generation, with ``state_dict()`` /
``load_state_dict()`` (JSON-compatible values plus the generator's byte tensor, so it
loads with ``torch.load(weights_only=True)``) and its own seeded ``torch.Generator``.

Life of a generation ``g`` (Jaderberg et al. 2017, Algorithm 1):

1. member ``i`` starts from the end-of-generation-``g−1`` state of ``sources[i]``
   (``None`` at ``g = 0``: fresh initialisation) with hyperparameters ``hparams[i]``;
2. it trains for the budget and is evaluated (``fitness[i]``; ``None`` when it failed);
3. :meth:`PopulationState.advance` records the generation in ``history`` and, unless it
   was the last one, runs exploit/explore to produce the next ``hparams`` / ``sources``.

The lineage (``history``) is enough to reconstruct any member's ancestry:
:func:`ancestry` walks the sources back from a final member and returns the
hyperparameter schedule that produced its weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ....config.strategy import Binary, Perturbation, Resample, Truncation
from .evolve import evolve, score
from .space import Space, sample_space

__all__ = ["PopulationState", "ancestry", "lineage_json"]


@dataclass
class PopulationState:
    """Population bookkeeping owned by rank 0; see the module docstring."""

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
        if size < 1:
            raise ValueError(f"population_size must be >= 1 (got {size})")
        g = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
        hparams = [sample_space(space, g) for _ in range(size)]
        return cls(size=size, seed=seed, hparams=hparams, sources=[None] * size, gen=g)

    def advance(
        self,
        fitness: Sequence[float | None],
        *,
        mode: str,
        space: Space,
        exploit_strategy: Truncation | Binary,
        explore_strategy: Perturbation | Resample,
        evolve_now: bool = True,
        frozen: Iterable[str] = (),
        errors: Sequence[str | None] | None = None,
        metrics: Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """Record generation ``self.generation`` and prepare the next; returns its record.

        Raises ``RuntimeError`` when every member failed (no fitness to evolve on).
        """
        if len(fitness) != self.size:
            raise ValueError(f"expected {self.size} fitness values, got {len(fitness)}")
        scores = [score(f, mode) for f in fitness]
        if all(s == float("-inf") for s in scores):
            first = next((e for e in (errors or []) if e), "no fitness reported")
            raise RuntimeError(
                f"generation {self.generation}: every member failed, so there is no fitness "
                f"to evolve on (first failure: {first})"
            )
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
            new, sources, copies = evolve(
                self.hparams, scores, space=space, exploit_strategy=exploit_strategy,
                explore_strategy=explore_strategy, gen=self.gen, frozen=frozen,
            )
            record["copies"] = [c.to_json() for c in copies]
            self.hparams = new
            self.sources = list(sources)
        else:
            self.sources = list(range(self.size))
        self.history.append(record)
        self.generation += 1
        return record

    def best(self, mode: str = "max") -> int:
        """Index of the best member of the last recorded generation (lowest index on ties)."""
        if not self.history:
            raise ValueError("no generation recorded yet")
        fit = self.history[-1]["fitness"]
        scores = [score(f, mode) for f in fit]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

    # -------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        doc = {
            "size": self.size, "seed": self.seed, "generation": self.generation,
            "hparams": self.hparams, "sources": self.sources, "history": self.history,
        }
        # JSON text: exact round trip of floats and of arbitrary choice values.
        return {"json": json.dumps(doc), "generator": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        doc = json.loads(state["json"])
        self.size = int(doc["size"])
        self.seed = int(doc["seed"])
        self.generation = int(doc["generation"])
        self.hparams = list(doc["hparams"])
        self.sources = list(doc["sources"])
        self.history = list(doc["history"])
        self.gen = torch.Generator()
        self.gen.set_state(state["generator"])

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PopulationState:
        obj = cls(size=1, seed=0)
        obj.load_state_dict(state)
        return obj


def ancestry(history: Sequence[dict[str, Any]], member: int) -> list[dict[str, Any]]:
    """The schedule that produced ``member``'s final weights, oldest first.

    One entry per generation: which member slot trained those weights then, with which
    hyperparameters, and its fitness. Walks ``sources`` backwards from the last record.
    """
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
    """The lineage document written to ``lineage.json``."""
    return {
        "population_size": state.size, "metric": metric, "mode": mode,
        "generations": state.history,
        "next": {"generation": state.generation, "hparams": state.hparams, "sources": state.sources},
    }
