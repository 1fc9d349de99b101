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
did not exist before, and the training losses since the last evaluation.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

__all__ = ["param_names", "merge", "localize", "ReshardWarning"]


class ReshardWarning(UserWarning):
    """A resume onto another layout: what was reset."""


def param_names(module: nn.Module, optimizer: torch.optim.Optimizer,
                names: Mapping[str, str] | None = None) -> list[str]:
    """The model names of ``optimizer``'s parameters in ``param_groups`` order
    (``names`` maps ``module``'s own names to the model's; identity when None)."""
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out: list[str] = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            local = by_id.get(id(p))
            if local is None:
                raise RuntimeError("an optimizer parameter is not a parameter of the module")
            out.append(names.get(local, local) if names is not None else local)
    return out


def merge(states: Sequence[Mapping[str, Any]], *, source: str) -> dict[str, Any]:
    """One state by model names from every old process's ``states`` (process order)."""
    first = states[0]
    named_model: dict[str, torch.Tensor] = {}
    named_opt: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for rank, s in enumerate(states):
        keys, names = list(s["model"]), s.get("names")
        pnames = s.get("param_names")
        if names is None or pnames is None:
            raise ConfigError([("checkpoint", (
                f"{source} was written before checkpoints carried the model's names and cannot "
                "be resumed on another layout; resume with the original settings"))])
        for k, n in zip(keys, names, strict=True):
            named_model.setdefault(n, s["model"][k])
        opt = s["optimizer"]
        for i, st in opt.get("state", {}).items():
            named_opt.setdefault(pnames[int(i)], st)
        if rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    return {
        "named_model": named_model, "named_optimizer": named_opt, "groups": groups,
        "scheduler": first["scheduler"], "step": first["step"], "epoch": first["epoch"],
        "batch": first["batch"], "optimizer_type": first.get("optimizer_type"),
        "rng_by_rank": [s["rng"] for s in states], "layout": first.get("layout"),
        "engine_state_keys": sorted({k for s in states for k in (s.get("engine") or {})}),
    }


def localize(merged: Mapping[str, Any], *, module: nn.Module, optimizer: torch.optim.Optimizer,
             names: Mapping[str, str] | None, rank: int, layout: Mapping[str, Any],
             source: str, warn: bool) -> dict[str, Any]:
    """This process's state, in its own keys and parameter order, from ``merged``."""
    current = module.state_dict()
    # an empty placeholder (a pipeline rank that owns no parameters) has nothing to load
    own = [k for k in current if current[k].numel() > 0]
    to_model = {k: (names.get(k, k) if names is not None else k) for k in current}
    missing = [to_model[k] for k in own if to_model[k] not in merged["named_model"]]
    if missing:
        raise ConfigError([("model", (
            f"checkpoint {source} holds no {', '.join(missing[:5])}: it was written for another "
            "model; resume with the original model"))])
    model_state = {k: merged["named_model"][to_model[k]] if k in own else current[k] for k in current}
    pnames = param_names(module, optimizer, names)
    saved_groups = merged["groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ConfigError([("train.optimizer", (
            f"checkpoint {source} has {len(saved_groups)} parameter groups; this job's optimizer "
            f"has {len(optimizer.param_groups)}"))])
    state: dict[int, Any] = {}
    for i, n in enumerate(pnames):
        if n in merged["named_optimizer"]:
            state[i] = merged["named_optimizer"][n]
    groups, i = [], 0
    for saved, g in zip(saved_groups, optimizer.param_groups, strict=True):
        groups.append({**saved, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    rngs = merged["rng_by_rank"]
    reset = []
    if merged["engine_state_keys"]:
        reset.append(f"the strategy's own state ({', '.join(merged['engine_state_keys'])}: "
                     "e.g. compressor residuals, per process)")
    if rank >= len(rngs):
        reset.append(f"the random state of process {rank} (it did not exist)")
    if warn:
        old = merged.get("layout") or {}
        warnings.warn(
            f"resuming {source} (layout {dict(old)}) on layout {dict(layout)}: the model and "
            f"optimizer state continue by name at step {merged['step']}; reset: "
            f"{'; '.join(reset + ['the training losses since the last evaluation'])}",
            ReshardWarning, stacklevel=2)
    return {
        "model": model_state, "optimizer": {"state": state, "param_groups": groups},
        "scheduler": merged["scheduler"], "rng": rngs[rank] if rank < len(rngs) else None,
        "engine": {}, "step": merged["step"], "epoch": merged["epoch"], "batch": merged["batch"],
        "losses": [], "optimizer_type": merged["optimizer_type"],
    }
