"""PopulationBased failures: which members lost their state, and the first error of each.

A member that fails before it ever saved a state (in generation 0, or sourced from such
a member) has nothing to continue from. Under ``population.evolve = false`` (or when
exploit does not replace it) it stays failed; every later generation then reports *its
first failure* instead of a missing-file error that hides it. The population record of a
generation carries ``lost`` (member -> that first failure), so a resume knows it too; rank
0 warns at each member's first failure and the summary lists them (``first_failures``).
"""

from __future__ import annotations

import warnings
from typing import Any

from .pbt import PopulationState

__all__ = ["lost_before", "lost_after", "warn_first_failures", "first_failures"]


def lost_before(pop: PopulationState) -> dict[str, str]:
    """Members with no state file after the last recorded generation (str(member) -> the
    failure that left them so, "generation <g>: <error>"); a member sourced from one of them
    has nothing to load and fails naming that first failure."""
    return dict(pop.history[-1].get("lost", {})) if pop.history else {}


def lost_after(ordered: list[dict[str, Any]], lost: dict[str, str], g: int) -> dict[str, str]:
    """:func:`lost_before` after generation ``g``: a member that ends it without state keeps its
    source's first failure, or its own error when its source had state (or none)."""
    out: dict[str, str] = {}
    for r in ordered:
        if not r.get("has_state", True):
            out[str(r["member"])] = lost.get(str(r["source"])) or f"generation {g}: {r['error']}"
    return out


def warn_first_failures(pop: PopulationState, ordered: list[dict[str, Any]],
                         lost: dict[str, str], *, evolve: bool) -> None:
    """Rank 0 warns once per member, at its first failure, with the member's message."""
    failed_before = {i for rec in pop.history[:-1] for i, e in enumerate(rec["errors"]) if e}
    for r in ordered:
        i = r["member"]
        if r["error"] and i not in failed_before:
            stays = (" It has no state to continue from; with population.evolve = false it is "
                     "never replaced and fails every later generation."
                     if str(i) in lost and not evolve else "")
            warnings.warn(f"PopulationBased member {i} failed in generation {r['generation']}: "
                          f"{r['error']}.{stays}", RuntimeWarning, stacklevel=2)


def first_failures(pop: PopulationState) -> dict[str, str]:
    """Each member that ever failed -> its first failure ("generation <g>: <error>")."""
    out: dict[str, str] = {}
    for rec in pop.history:
        for i, e in enumerate(rec["errors"]):
            if e and str(i) not in out:
                out[str(i)] = f"generation {rec['generation']}: {e}"
    return out
