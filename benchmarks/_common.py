"""Shared by the benchmark scripts (never by the library or the tests): the provenance map
each benchmark prints next to its figures, and medians.

``provenance(results, modelled=..., mixed=...)`` walks the result tree and labels every
numeric leaf by its key name: ``modelled`` (a formula: a cost model, a theory bound, a
simulation), ``measured / modelled`` (a measured figure divided by a modelled one), or
``measured`` (counted or timed in this run, including ratios of two measured figures),
or ``configured`` (a setting echoed back: stage counts, micro-batches).
Keys ending in ``_measured`` / ``_modelled`` label themselves. Subtrees named in ``skip``
(the configuration echo) get no labels.

``figures(result)`` lists every number of a benchmark's printed object with its label, by
path (what ``make bench``'s RESULTS.md tabulates and the smoke test checks): numbers under
``config`` or ``goals`` are ``configured``; any other takes its key's label in the object's
``provenance`` map, else its key's own suffix, else the suffix of the nearest enclosing key
(``wall_s_measured: {"paratrain": ...}``); a number none of these labels is
``UNLABELLED``, which the smoke test refuses.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["provenance", "figures", "median", "warm_workers", "MEASURED", "MODELLED", "MIXED", "CONFIGURED", "UNLABELLED"]

MEASURED, MODELLED, MIXED, CONFIGURED = "measured", "modelled", "measured / modelled", "configured"
UNLABELLED = "unlabelled"
SETTINGS = ("config", "goals")  # subtrees whose numbers are settings, not figures


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def warm_workers(*modules: str) -> None:
    """Start paratrain's forkserver, which ``run_distributed`` forks every rank from, with
    torch's compiler front end and ``modules`` imported: what each rank would import itself
    (DDP, DTensor and pipelining import ``torch._dynamo``: about 4 s of CPU a process on 2
    cores) is imported once. A no-op when the server already runs; nothing timed changes."""
    from paratrain.comm.forkserver import warm

    warm(["torch._dynamo", *modules])


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


def _suffix(key: str) -> str | None:
    if key.endswith("_measured"):
        return MEASURED
    if key.endswith("_modelled"):
        return MODELLED
    return None


def figures(result: Mapping[str, Any]) -> list[tuple[str, float, str]]:
    """``(path, value, label)`` of every number in ``result`` (a benchmark's printed object)
    outside its ``provenance`` map, in document order; paths join keys with ``.`` and list
    indices as ``[i]``."""
    labels = result.get("provenance")
    labels = labels if isinstance(labels, Mapping) else {}
    rows: list[tuple[str, float, str]] = []

    def label(keys: list[str]) -> str:
        if any(k in SETTINGS for k in keys):
            return CONFIGURED
        leaf = keys[-1]
        if isinstance(labels.get(leaf), str):
            return str(labels[leaf])
        for k in reversed(keys):
            found = _suffix(k)
            if found is not None:
                return found
        return UNLABELLED

    def walk(path: str, keys: list[str], v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                if not (not keys and k == "provenance"):
                    walk(f"{path}.{k}" if path else str(k), [*keys, str(k)], x)
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                walk(f"{path}[{i}]", keys, x)
        elif _numeric(v) and keys:
            rows.append((path, v, label(keys)))

    walk("", [], result)
    return rows
