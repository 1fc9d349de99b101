"""Resume on another world: a checkpoint by the model's own names, laid out anew.

Every checkpoint of the one loop records, beside each process's tensors, their names in
the *model* (``names``: the model's name of each ``state["model"]`` key, in order) and the
model names of the optimizer's parameters in ``param_groups`` order (``param_names``),
and the run's ``layout`` (strategy, processes, placement). A resume whose layout differs
(DataParallel on 2 replicas -> 4 or 1, a pipeline on 3 workers -> 2 or another
placement) then proceeds in three steps:

1. :func:`merge`: every old process's state becomes one state keyed by model names:
   ``named_model[name] = tensor`` and ``named_optimizer = {"state": {name: {...}},
   "groups": [...]}`` (a name several processes hold, e.g. a replica's, keeps the first:
   they are equal), plus the loop's position and lr-scheduler state (process 0's).
2. The merged state travels to every new process (the store broadcasts it).
3. :func:`localize`: each new process takes the names it holds now, maps them to its own
   keys and parameter order, and gets a state ``run_loop`` loads as usual.

What cannot be carried over is reset, with one warning naming it: the engine's own state
(compressor residuals, aggregator counters are per process), the RNG of a process that
did not exist before (it takes process 0's: the ranks of a tensor-parallel group must draw
alike), and the training losses since the last evaluation.

Shards. A process that holds only part of a model tensor (a tensor-parallel shard) saves,
beside its name, a *shard spec* (``shards``, and ``param_shards`` for its optimizer
parameters): ``{"shape": the model tensor's shape, "slices": [[dim, start, length], ...]}``,
where this tensor lies in it (a column shard of a fused ``in_proj_weight`` is one slice of
rows of it). :func:`merge` assembles the pieces of a name into the whole tensor (an error
when they do not cover it) and :func:`localize` cuts a process's piece out of the whole
one; optimizer state tensors of a parameter's shape (Adam's moments) are sharded like the
parameter, the others (``step``) are taken whole. Every loaded tensor must have the shape
the process holds now, else a ConfigError names it: nothing is loaded into a wrong place.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

__all__ = ["param_names", "param_keys", "merge", "localize", "take", "by_examples", "ReshardWarning"]

Spec = Mapping[str, Any]  # {"shape": [...], "slices": [[dim, start, length], ...]}


class ReshardWarning(UserWarning):
    """A resume onto another layout: what was reset."""


def param_keys(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """``module``'s names of ``optimizer``'s parameters in ``param_groups`` order."""
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out: list[str] = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            local = by_id.get(id(p))
            if local is None:
                raise RuntimeError("an optimizer parameter is not a parameter of the module")
            out.append(local)
    return out


def param_names(module: nn.Module, optimizer: torch.optim.Optimizer,
                names: Mapping[str, str] | None = None) -> list[str]:
    """The model names of ``optimizer``'s parameters in ``param_groups`` order
    (``names`` maps ``module``'s own names to the model's; identity when None)."""
    return [names.get(k, k) if names is not None else k for k in param_keys(module, optimizer)]


def _piece_shape(spec: Spec) -> tuple[int, ...]:
    shape = list(spec["shape"])
    for dim, _, length in spec["slices"]:
        shape[int(dim)] = int(length)
    return tuple(shape)


def take(full: torch.Tensor, spec: Spec | None) -> torch.Tensor:
    """The piece of model tensor ``full`` that ``spec`` says a process holds."""
    if spec is None:
        return full
    for dim, start, length in spec["slices"]:
        full = full.narrow(int(dim), int(start), int(length))
    return full.clone()


class _Pieces:
    """The pieces of sharded tensors by key, assembled into whole tensors."""

    def __init__(self) -> None:
        self.by_key: dict[Any, tuple[list[int], dict[str, tuple[Spec, torch.Tensor]]]] = {}

    def add(self, key: Any, spec: Spec, t: torch.Tensor) -> None:
        _, got = self.by_key.setdefault(key, ([int(x) for x in spec["shape"]], {}))
        got.setdefault(json.dumps(spec["slices"]), (spec, t))  # replicas of a piece: the first

    def whole(self, key: Any, *, source: str) -> torch.Tensor:
        shape, got = self.by_key[key]
        first = next(iter(got.values()))[1]
        out = torch.empty(shape, dtype=first.dtype)
        covered = 0
        for spec, t in got.values():
            view = out
            for dim, start, length in spec["slices"]:
                view = view.narrow(int(dim), int(start), int(length))
            view.copy_(t)
            covered += t.numel()
        if covered != out.numel():
            raise ConfigError([("checkpoint", (
                f"{source}: the saved pieces of {key} cover {covered} of its {out.numel()} "
                "elements (a process's checkpoint is missing or of another run); resume with "
                "the original settings"))])
        return out


def merge(states: Sequence[Mapping[str, Any]], *, source: str) -> dict[str, Any]:
    """One state by model names from every old process's ``states`` (process order)."""
    first = states[0]
    named_model: dict[str, torch.Tensor] = {}
    named_opt: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    pieces, opt_pieces = _Pieces(), _Pieces()
    differed: list[str] = []  # held by several processes with other values (not replicas)
    for rank, s in enumerate(states):
        keys, names = list(s["model"]), s.get("names")
        pnames = s.get("param_names")
        if names is None or pnames is None:
            raise ConfigError([("checkpoint", (
                f"{source} was written before checkpoints carried the model's names and cannot "
                "be resumed on another layout; resume with the original settings"))])
        shards = s.get("shards") or [None] * len(keys)
        pshards = s.get("param_shards") or [None] * len(pnames)
        for k, n, spec in zip(keys, names, shards, strict=True):
            if spec is None:
                held = named_model.setdefault(n, s["model"][k])
                if held is not s["model"][k] and n not in differed and not torch.equal(held, s["model"][k]):
                    differed.append(n)
            else:
                pieces.add(n, spec, s["model"][k])
        opt = s["optimizer"]
        for i, st in opt.get("state", {}).items():
            n, spec = pnames[int(i)], pshards[int(i)]
            if spec is None:
                named_opt.setdefault(n, st)
                continue
            part = _piece_shape(spec)
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == part:
                    opt_pieces.add((n, key), spec, v)  # sharded like its parameter
                else:
                    named_opt.setdefault(n, {}).setdefault(key, v)
        if rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    for n in pieces.by_key:
        named_model.setdefault(n, pieces.whole(n, source=source))
    for n, key in opt_pieces.by_key:
        named_opt.setdefault(n, {})[key] = opt_pieces.whole((n, key), source=source)
    return {
        "named_model": named_model, "named_optimizer": named_opt, "groups": groups,
        "scheduler": first["scheduler"], "step": first["step"], "epoch": first["epoch"],
        "batch": first["batch"], "optimizer_type": first.get("optimizer_type"),
        "rng_by_rank": [s["rng"] for s in states], "layout": first.get("layout"),
        "differed": differed,
        "engine_state_keys": sorted({k for s in states for k, v in (s.get("engine") or {}).items()
                                     if v}),
    }


def localize(merged: Mapping[str, Any], *, module: nn.Module, optimizer: torch.optim.Optimizer,
             names: Mapping[str, str] | None, rank: int, layout: Mapping[str, Any],
             source: str, warn: bool, shards: Mapping[str, Spec] | None = None,
             world: int = 1) -> dict[str, Any]:
    """This process's state, in its own keys and parameter order, from ``merged``
    (``shards``: the spec of each of ``module``'s keys that holds part of a model tensor;
    ``world``: how many processes resume, for the warning)."""
    shards = shards or {}
    current = module.state_dict()
    # an empty placeholder (a pipeline rank that owns no parameters) has nothing to load
    own = [k for k in current if current[k].numel() > 0]
    to_model = {k: (names.get(k, k) if names is not None else k) for k in current}
    missing = [to_model[k] for k in own if to_model[k] not in merged["named_model"]]
    if missing:
        raise ConfigError([("model", (
            f"checkpoint {source} holds no {', '.join(missing[:5])}: it was written for another "
            "model; resume with the original model"))])
    # the whole tensor must have the shape this process's piece was cut from (a piece of
    # the right shape cut from another shape would load wrong values)
    want = {k: tuple(shards[k]["shape"]) if k in shards else tuple(current[k].shape) for k in own}
    wrong = [f"{to_model[k]}: checkpoint {tuple(merged['named_model'][to_model[k]].shape)}, this "
             f"job {want[k]}" for k in own if tuple(merged["named_model"][to_model[k]].shape) != want[k]]
    if wrong:
        raise ConfigError([("model", (
            f"checkpoint {source} does not fit this job's model: {'; '.join(wrong[:5])}; resume "
            "with the original model"))])
    model_state = {k: take(merged["named_model"][to_model[k]], shards.get(k)) if k in own
                   else current[k] for k in current}
    pkeys = param_keys(module, optimizer)
    pnames = [names.get(k, k) if names is not None else k for k in pkeys]
    saved_groups = merged["groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ConfigError([("train.optimizer", (
            f"checkpoint {source} has {len(saved_groups)} parameter groups; this job's optimizer "
            f"has {len(optimizer.param_groups)}"))])
    state: dict[int, Any] = {}
    for i, (k, n) in enumerate(zip(pkeys, pnames, strict=True)):
        if n in merged["named_optimizer"]:
            spec = shards.get(k)
            whole = tuple(spec["shape"]) if spec is not None else None
            state[i] = {key: take(v, spec) if isinstance(v, torch.Tensor) and tuple(v.shape) == whole
                        else v for key, v in merged["named_optimizer"][n].items()}
    groups, i = [], 0
    for saved, g in zip(saved_groups, optimizer.param_groups, strict=True):
        groups.append({**saved, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    rngs = merged["rng_by_rank"]
    reset = []
    if merged.get("differed"):
        shown = ", ".join(merged["differed"][:4]) + (" ..." if len(merged["differed"]) > 4 else "")
        reset.append(f"tensors the old processes held with different values ({shown}: e.g. "
                     "Local subgraph layers, Decentralized replicas) now take process 0's")
    if merged["engine_state_keys"]:
        reset.append(f"the strategy's own state ({', '.join(merged['engine_state_keys'])}: "
                     "e.g. compressor residuals, per process)")
    if max(world, rank + 1) > len(rngs):
        reset.append(f"the random state of processes {len(rngs)}..{max(world, rank + 1) - 1} "
                     "(they did not exist: they take process 0's)")
    if warn:
        old = merged.get("layout") or {}
        warnings.warn(
            f"resuming {source} (layout {dict(old)}) on layout {dict(layout)}: the model and "
            f"optimizer state continue by name at step {merged['step']}; reset: "
            f"{'; '.join(reset + ['the training losses since the last evaluation'])}",
            ReshardWarning, stacklevel=2)
    return {
        "model": model_state, "optimizer": {"state": state, "param_groups": groups},
        "scheduler": merged["scheduler"], "rng": rngs[rank] if rank < len(rngs) else rngs[0],
        "engine": {}, "step": merged["step"], "epoch": merged["epoch"], "batch": merged["batch"],
        "losses": [], "optimizer_type": merged["optimizer_type"],
    }


def by_examples(old: Mapping[str, Any], new: Mapping[str, Any], *, epoch: int, batch: int,
                per_epoch: int) -> tuple[int, int]:
    """``(epoch, batch)`` on layout ``new`` after the examples the data replicas of layout
    ``old`` (``"replicas"``, 1 when absent: Local, tensor parallel, a pipeline) had walked:
    each took ``batch * batch_size`` of its share of the epoch's permutation."""
    moved = batch * int(old.get("replicas", 1)) // int(new.get("replicas", 1))
    return (epoch + 1, 0) if moved >= per_epoch else (epoch, moved)
