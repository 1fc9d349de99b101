"""Shared by the benchmark scripts (never by the library or the tests): the provenance map
each benchmark prints next to its figures, and medians.

``provenance(results, modelled=..., mixed=...)`` walks the result tree and labels every
numeric leaf by its key name: ``modelled`` (a formula: a cost model, a theory bound, a
simulation), ``measured / modelled`` (a measured figure divided by a modelled one), or
``measured`` (counted or timed in this run, including ratios of two measured figures),
or ``configured`` (a setting echoed back: stage counts, micro-batches).
Keys ending in ``_measured`` / ``_modelled`` label themselves. Subtrees named in ``skip``
(the configuration echo) get no labels.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["provenance", "median", "MEASURED", "MODELLED", "MIXED", "CONFIGURED"]

MEASURED, MODELLED, MIXED, CONFIGURED = "measured", "modelled", "measured / modelled", "configured"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def provenance(results: Any, *, modelled: Iterable[str] = (), mixed: Iterable[str] = (),
               configured: Iterable[str] = (),
               skip: Iterable[str] = ("config", "goals", "provenance")) -> dict[str, str]:
    mod, mix, conf, skp = set(modelled), set(mixed), set(configured), set(skip)
    out: dict[str, str] = {}

    def label(key: str) -> str:
        if key in mod or key.endswith("_modelled"):
            return MODELLED
        if key in mix:
            return MIXED
        if key in conf:
            return CONFIGURED
        return MEASURED

    def walk(key: str | None, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                if str(k) not in skp:
                    walk(str(k), x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(key, x)
        elif _numeric(v) and key is not None:
            out[key] = label(key)

    walk(None, results)
    return dict(sorted(out.items()))
