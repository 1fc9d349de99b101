"""Strategies on subgraphs (issue 15, part 3): the job's ``[subgraphs]`` table.

A job's ``[strategy]`` is the root's. ``[subgraphs."<path>"]`` sets the strategy of one
module of the model, named by its path in ``model.named_modules()`` (``head``,
``encoder.norm``); every table has the exact ``[strategy]`` shape. Inheritance:

    effective_strategy(p) = subgraphs[p]                      if p is a key
                          = subgraphs[q]  for the longest key q that is a dotted prefix of p
                          = [strategy]                        otherwise

A subgraph's strategy is paired with its parent's (the nearest ancestor key's, else the
root's). The pairings honoured (:data:`SUPPORTED_PAIRINGS`):

- root ``Federated`` + ``Local``: the subgraph is personal to each client (trained locally,
  never sent, never aggregated, kept per client across rounds and in the checkpoint): FedPer
  (Arivazhagan et al. 2019) when it is the head, FedBN (Li et al. 2021) when it is the
  normalisation layers;
- root ``DataParallel`` + ``Local``: not synchronised (its gradients are not averaged, each
  replica keeps and checkpoints its own copy);
- root ``ModelParallel`` + ``DataParallel{num_replicas}``: a replicated stage;
- a strategy equal to its parent's: a no-op;
- under ``Custom``, anything: the coordinator receives the whole job.

Every other pairing is a :class:`~paratrain.config.ConfigError` naming ``subgraphs.<key>``
and listing these. This module is pure (no process group): the executors call
:func:`local_state_keys` / :func:`local_parameter_names` for what stays local.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from .config import ConfigError

__all__ = [
    "SUPPORTED_PAIRINGS", "effective_strategy", "nearest_ancestor", "check_pairings",
    "check_paths", "check_job", "local_paths", "local_state_keys", "local_parameter_names",
    "local_buffer_names",
    "pairings_text",
]

# (root type, subgraph type, what the runtime does)
SUPPORTED_PAIRINGS: tuple[tuple[str, str, str], ...] = (
    ("Federated", "Local", "personal to each client: trained locally, never sent or aggregated "
                           "(FedPer; FedBN with the normalisation layers)"),
    ("DataParallel", "Local", "not synchronised: each replica keeps and checkpoints its own copy"),
    ("ModelParallel", "DataParallel", "a replicated stage: its rows of each micro-batch split over "
                                      "num_replicas workers, gradients averaged among them"),
)


def pairings_text() -> str:
    """The supported pairings, in one line (error messages)."""
    pairs = "; ".join(f"{root} + {sub} ({what})" for root, sub, what in SUPPORTED_PAIRINGS)
    return (f"supported pairings ([strategy] + [subgraphs.<path>]): {pairs}; a strategy equal to "
            "its parent's (a no-op); anything under Custom (the coordinator's to use)")


def _type(strategy: Any) -> str:
    return str(getattr(strategy, "type", strategy))


def nearest_ancestor(path: str, keys: Iterable[str]) -> str | None:
    """The longest key that is a proper dotted prefix of ``path`` (``a`` of ``a.b.c``), or None."""
    probe = path
    known = set(keys)
    while "." in probe:
        probe = probe.rpartition(".")[0]
        if probe in known:
            return probe
    return None


def effective_strategy(path: str, subgraphs: Mapping[str, Any], root: Any) -> Any:
    """The strategy of module ``path``: its own, else its nearest ancestor's, else ``root``
    (``path = ""`` is the root)."""
    if path in subgraphs:
        return subgraphs[path]
    parent = nearest_ancestor(path, subgraphs) if path else None
    return subgraphs[parent] if parent is not None else root


def _field(key: str) -> str:
    return f"subgraphs.{key}" if key else 'subgraphs.""'


def _key_problem(key: str) -> str | None:
    if not key:
        return "the root's strategy is [strategy]; a subgraph key is a module path such as 'head'"
    if any(not part for part in key.split(".")) or any(c.isspace() for c in key):
        return f"{key!r} is not a module path (dotted names of model.named_modules(), e.g. 'encoder.norm')"
    return None


def check_pairings(job: Any) -> None:
    """ConfigError (one problem per key, ``subgraphs.<key>``) for a malformed key or a pairing
    the runtime does not honour; needs no model."""
    subs: Mapping[str, Any] = job.subgraphs
    root = job.strategy
    problems: list[tuple[str, str]] = []
    tp = job.tensor_parallel is not None and job.tensor_parallel.tensor_parallel_size > 1
    for key in sorted(subs):
        bad = _key_problem(key)
        if bad is not None:
            problems.append((_field(key), bad))
            continue
        sub = subs[key]
        anc = nearest_ancestor(key, subs)
        parent = subs[anc] if anc is not None else root
        if sub == parent:
            continue  # same strategy as the parent: a no-op
        if _type(root) == "Custom":
            continue  # the coordinator receives the whole job, [subgraphs] included
        where = f"subgraph {anc!r}" if anc is not None else "[strategy]"
        if _type(sub) == _type(parent):
            problems.append((_field(key), (
                f"{_type(sub)} differs from its parent's ({where}) in its fields; a subgraph with "
                f"its parent's type is a no-op only when equal to it. {pairings_text()}")))
            continue
        if anc is not None or (_type(root), _type(sub)) not in {(r, s) for r, s, _ in SUPPORTED_PAIRINGS}:
            problems.append((_field(key), (
                f"{_type(sub)} under {_type(parent)} ({where}) is not supported. {pairings_text()}")))
            continue
        if tp and _type(root) == "DataParallel":
            problems.append((_field(key), (
                "a Local subgraph under DataParallel is not supported with tensor_parallel_size > 1 "
                "(the tensor-parallel executor synchronises every parameter)")))
    if problems:
        raise ConfigError(problems)


def _suggest(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    if close:
        return f"nearest: {', '.join(close)}"
    shown = names[:24]
    more = f", ... ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
    return f"module paths: {', '.join(shown)}{more}"


def local_paths(job: Any) -> list[str]:
    """The keys whose ``Local`` strategy keeps a part of the model out of synchronisation:
    ``Local`` keys (not no-ops) under a root ``Federated`` or ``DataParallel``."""
    if _type(job.strategy) not in ("Federated", "DataParallel"):
        return []
    subs: Mapping[str, Any] = job.subgraphs
    return sorted(k for k, s in subs.items()
                  if _type(s) == "Local" and _type(effective_strategy(nearest_ancestor(k, subs) or "",
                                                                       subs, job.strategy)) != "Local")


def _under(name: str, paths: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in paths)


def check_paths(model: Any, job: Any) -> None:
    """ConfigError unless every key is a module path of ``model`` (``subgraphs.<key>``, with
    the nearest names); a Local subgraph must hold parameters or buffers, and share none of
    them (tied weights) with a module outside it."""
    subs: Mapping[str, Any] = job.subgraphs
    if not subs:
        return
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    problems: list[tuple[str, str]] = []
    for key in sorted(subs):
        if key not in modules or not key:
            problems.append((_field(key), f"the model has no module {key!r}; {_suggest(key, names)}"))
    local = local_paths(job)
    if not problems and local:
        entries = model.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for name, t in entries.items():
            groups.setdefault(id(t), []).append(name)
        for key in local:
            if not any(_under(n, [key]) for n in entries):
                problems.append((_field(key), f"module {key!r} holds no parameters or buffers: "
                                              "a Local subgraph would keep nothing"))
                continue
            for aliases in groups.values():
                inside = [n for n in aliases if _under(n, local)]
                outside = [n for n in aliases if not _under(n, local)]
                if any(_under(n, [key]) for n in inside) and outside:
                    problems.append((_field(key), (
                        f"{inside[0]} is tied to {outside[0]} (one tensor), which is outside the "
                        "Local subgraphs: it cannot be both local and shared; untie it (e.g. "
                        "model.tie_weights = false) or make both modules Local")))
    if problems:
        raise ConfigError(problems)


def check_job(job: Any, model: Any = None) -> None:
    """Every check: pairings, then (with ``model``) the module paths."""
    check_pairings(job)
    if model is not None:
        check_paths(model, job)


def local_state_keys(model: Any, job: Any) -> list[str]:
    """The ``unique_state_dict`` keys (parameters and buffers, a tied tensor once) inside the
    job's Local subgraphs, in state-dict order; validates the job's paths first."""
    from .models.state import unique_state_dict

    paths = local_paths(job)
    if not paths:
        return []
    check_paths(model, job)
    return [k for k in unique_state_dict(model) if _under(k, paths)]


def local_parameter_names(model: Any, job: Any) -> set[str]:
    """The ``named_parameters`` names inside the job's Local subgraphs."""
    paths = local_paths(job)
    if not paths:
        return set()
    check_paths(model, job)
    return {n for n, _ in model.named_parameters() if _under(n, paths)}


def local_buffer_names(model: Any, job: Any) -> set[str]:
    """The ``named_buffers`` names inside the job's Local subgraphs (never broadcast: a
    replica's own statistics, as its own parameters)."""
    paths = local_paths(job)
    return {n for n, _ in model.named_buffers() if _under(n, paths)} if paths else set()
