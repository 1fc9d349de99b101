"""Strategies on subgraphs (issue 15, part 3): the job's ``[subgraphs]`` table
(docs/subgraphs.md).

``[subgraphs."<path>"]`` sets the strategy of one module, by its path in
``model.named_modules()``; a key may be a pattern naming many (a glob over the paths, or
``"class:<Name>"``: every module whose class or a base class is named so), which stands
for the explicit tables of the modules it matches (:func:`resolve`). Inheritance:

    effective_strategy(p) = subgraphs[p]                      if p is a key
                          = subgraphs[q]  for the longest key q that is a dotted prefix of p
                          = [strategy]                        otherwise

A subgraph's strategy is paired with its parent's; the pairings honoured are
:data:`SUPPORTED_PAIRINGS`, a strategy equal to its parent's (a no-op) and anything under
``Custom``. Every other is a ConfigError naming ``subgraphs.<key>``. Pure (no process group).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError

CLASS_PREFIX = "class:"

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


def strategy_type(strategy: Any) -> str:
    """A strategy's ``type`` (``Local``, ``Federated``, ...)."""
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


def is_pattern(key: str) -> bool:
    """``key`` names modules by a glob (``*``, ``?``, ``[``) or by class (``class:``)."""
    return key.startswith(CLASS_PREFIX) or any(c in key for c in "*?[")


def _key_problem(key: str) -> str | None:
    if not key:
        return "the root's strategy is [strategy]; a subgraph key is a module path such as 'head'"
    if key.startswith(CLASS_PREFIX):
        name = key[len(CLASS_PREFIX):]
        if not name or any(c.isspace() or c == "." for c in name):
            return (f"{key!r}: 'class:' takes a module class name (a glob allowed), e.g. "
                    "'class:BatchNorm2d' or 'class:BatchNorm*'")
        return None
    if any(not part for part in key.split(".")) or any(c.isspace() for c in key):
        return f"{key!r} is not a module path (dotted names of model.named_modules(), e.g. 'encoder.norm')"
    return None


def _tp(job: Any) -> bool:
    return job.tensor_parallel is not None and job.tensor_parallel.tensor_parallel_size > 1


def check_pairings(job: Any) -> None:
    """ConfigError (one problem per key, ``subgraphs.<key>``) for a malformed key or a pairing
    the runtime does not honour; needs no model (a pattern key is checked as one subgraph
    here, and each module it matches once the model is built: :func:`check_paths`)."""
    subs: Mapping[str, Any] = job.subgraphs
    problems: list[tuple[str, str]] = []
    for key in sorted(subs):
        bad = _key_problem(key)
        if bad is None and is_pattern(key) and strategy_type(job.strategy) == "ModelParallel":
            bad = (f"{key!r} is a pattern; under ModelParallel a replicated stage is named by its "
                   "module path (patterns select Local subgraphs under Federated or DataParallel)")
        if bad is not None:
            problems.append((_field(key), bad))
    if not problems:
        problems = _pairing_problems(subs, job.strategy, _tp(job))
    if problems:
        raise ConfigError(problems)


def _pairing_problems(subs: Mapping[str, Any], root: Any, tp: bool,
                      origin: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """The unsupported pairings of the table ``subs``; ``origin`` (a resolved table's module
    path -> the pattern key that set it) names the key at fault and the module."""
    problems: list[tuple[str, str]] = []
    for key in sorted(subs):
        src = (origin or {}).get(key, key)
        name, what = _field(src), (f"module {key!r}: " if src != key else "")
        sub = subs[key]
        anc = nearest_ancestor(key, subs)
        parent = subs[anc] if anc is not None else root
        if sub == parent:
            continue  # same strategy as the parent: a no-op
        if strategy_type(root) == "Custom":
            continue  # the coordinator receives the whole job, [subgraphs] included
        where = f"subgraph {anc!r}" if anc is not None else "[strategy]"
        if strategy_type(sub) == strategy_type(parent):
            problems.append((name, (
                f"{what}{strategy_type(sub)} differs from its parent's ({where}) in its fields; a subgraph "
                f"with its parent's type is a no-op only when equal to it. {pairings_text()}")))
            continue
        pair = (strategy_type(root), strategy_type(sub))
        if anc is not None or pair not in {(r, s) for r, s, _ in SUPPORTED_PAIRINGS}:
            problems.append((name, (
                f"{what}{strategy_type(sub)} under {strategy_type(parent)} ({where}) is not supported. "
                f"{pairings_text()}")))
            continue
        if tp and strategy_type(root) == "DataParallel":
            problems.append((name, (
                f"{what}a Local subgraph under DataParallel is not supported with "
                "tensor_parallel_size > 1 (the tensor-parallel executor synchronises every "
                "parameter)")))
    return problems


@dataclass(frozen=True)
class Resolved:
    """``[subgraphs]`` with its patterns expanded over a model: ``table`` maps module paths
    to strategies (the explicit tables the patterns stand for), ``origin`` each path to the
    key that set it (itself for an exact key)."""

    table: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)


def _matches(key: str, name: str, module: Any) -> bool:
    if key.startswith(CLASS_PREFIX):
        pat = key[len(CLASS_PREFIX):]
        return any(fnmatch.fnmatchcase(c.__name__, pat) for c in type(module).__mro__
                   if c is not object)
    return fnmatch.fnmatchcase(name, key)


def resolve(model: Any, job: Any) -> Resolved:
    """The explicit table of ``job.subgraphs`` over ``model``: each pattern replaced by the
    modules it matches (an exact key wins; a module that would only inherit its nearest
    ancestor's equal strategy is left out); a ConfigError naming ``subgraphs.<key>`` for a
    pattern that matches nothing and for two patterns that disagree on a module."""
    subs: Mapping[str, Any] = job.subgraphs
    table = {k: v for k, v in subs.items() if not is_pattern(k)}
    origin = {k: k for k in table}
    patterns = sorted(k for k in subs if is_pattern(k))
    if not patterns:
        return Resolved(table, origin)
    modules = [(n, m) for n, m in model.named_modules() if n]
    problems: list[tuple[str, str]] = []
    matched: dict[str, str] = {}  # module path -> the first pattern key matching it
    for key in patterns:
        found = [(n, m) for n, m in modules if _matches(key, n, m)]
        # a module holding no tensor has nothing to keep apart (an activation "*" matched)
        hits = [n for n, m in found
                if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None]
        if not found:
            problems.append((_field(key), _no_match(key, modules)))
        elif not hits:
            problems.append((_field(key), (
                f"the pattern matches only modules holding no parameters or buffers "
                f"({', '.join(n for n, _ in found[:8])}): a subgraph there would keep nothing")))
        for n in hits:
            first = matched.setdefault(n, key)
            if first != key and subs[first] != subs[key] and n not in table:
                problems.append((_field(key), (
                    f"module {n!r} is matched by {first!r} too, with another strategy; "
                    f"name it exactly ([subgraphs.{n!r}], an exact path wins over patterns) "
                    "or narrow one pattern")))
    if problems:
        raise ConfigError(problems)
    for n in sorted((n for n in matched if n not in table), key=lambda p: (p.count("."), p)):
        anc = nearest_ancestor(n, table)
        inherited = table[anc] if anc is not None else job.strategy
        if subs[matched[n]] != inherited:
            table[n], origin[n] = subs[matched[n]], matched[n]
    return Resolved(table, origin)


def _no_match(key: str, modules: list[tuple[str, Any]]) -> str:
    if key.startswith(CLASS_PREFIX):
        classes = sorted({type(m).__name__ for _, m in modules})
        return (f"no module of the model is (or derives from) a class matching "
                f"{key[len(CLASS_PREFIX):]!r}; its classes: {', '.join(classes[:24])}"
                + (f", ... ({len(classes) - 24} more)" if len(classes) > 24 else ""))
    return f"the pattern {key!r} matches no module path; {_suggest(key, [n for n, _ in modules])}"


def _suggest(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    if close:
        return f"nearest: {', '.join(close)}"
    shown = names[:24]
    more = f", ... ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
    return f"module paths: {', '.join(shown)}{more}"


def local_paths(job: Any, model: Any = None) -> list[str]:
    """The ``Local`` keys (not no-ops) under a root ``Federated`` or ``DataParallel``: module
    paths with ``model`` (patterns resolved), else the keys as written."""
    if strategy_type(job.strategy) not in ("Federated", "DataParallel"):
        return []
    subs: Mapping[str, Any] = job.subgraphs if model is None else resolve(model, job).table
    return sorted(k for k, s in subs.items() if strategy_type(s) == "Local" and strategy_type(
        effective_strategy(nearest_ancestor(k, subs) or "", subs, job.strategy)) != "Local")


def under(name: str, paths: Iterable[str]) -> bool:
    """``name`` is one of the module ``paths`` or inside one."""
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
        if (key not in modules or not key) and not is_pattern(key):
            problems.append((_field(key), f"the model has no module {key!r}; {_suggest(key, names)}"))
    origin: dict[str, str] = {}
    if any(is_pattern(k) for k in subs):
        try:
            res = resolve(model, job)
        except ConfigError as e:
            problems += e.problems
        else:
            origin = res.origin
            if not problems:
                problems = _pairing_problems(res.table, job.strategy, _tp(job), origin)
    if problems:
        raise ConfigError(problems)
    local = local_paths(job, model)
    entries = model.state_dict(keep_vars=True) if local else {}
    groups: dict[int, list[str]] = {}  # a tensor's id -> its names (a tie: several)
    for name, t in entries.items():
        groups.setdefault(id(t), []).append(name)
    for key in local:
        src = origin.get(key, key)
        what = f"module {key!r}: " if src != key else ""
        if not any(under(n, [key]) for n in entries):
            problems.append((_field(src), f"module {key!r} holds no parameters or buffers: "
                                          "a Local subgraph would keep nothing"))
            continue
        for aliases in groups.values():
            inside = [n for n in aliases if under(n, local)]
            outside = [n for n in aliases if not under(n, local)]
            if any(under(n, [key]) for n in inside) and outside:
                problems.append((_field(src), (
                    f"{what}{inside[0]} is tied to {outside[0]} (one tensor), which is outside the "
                    "Local subgraphs: it cannot be both local and shared; untie it (e.g. "
                    "model.tie_weights = false) or make both modules Local")))
    if problems:
        raise ConfigError(problems)


def _checked_local(model: Any, job: Any) -> list[str]:
    """The Local subgraphs' module paths, the job's paths validated first."""
    if not local_paths(job):
        return []
    check_paths(model, job)
    return local_paths(job, model)


def local_state_keys(model: Any, job: Any) -> list[str]:
    """The ``unique_state_dict`` keys (a tied tensor once) inside the job's Local subgraphs,
    in state-dict order."""
    from .models.state import unique_state_dict

    paths = _checked_local(model, job)
    return [k for k in unique_state_dict(model) if under(k, paths)] if paths else []


def local_parameter_names(model: Any, job: Any) -> set[str]:
    """The ``named_parameters`` names inside the job's Local subgraphs."""
    paths = _checked_local(model, job)
    return {n for n, _ in model.named_parameters() if under(n, paths)}


def local_buffer_names(model: Any, job: Any) -> set[str]:
    """The ``named_buffers`` names inside the job's Local subgraphs (never broadcast: a
    replica's own statistics, as its own parameters)."""
    paths = local_paths(job, model) if local_paths(job) else []
    return {n for n, _ in model.named_buffers() if under(n, paths)} if paths else set()
