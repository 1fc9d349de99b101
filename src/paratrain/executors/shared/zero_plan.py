"""Which parameters a ZeRO run (``strategy.shard``) gathers and reduces together: the units
(``shard_unit``, as torch FSDP2's ``fully_shard`` per block) and the root, and the plan
``paratrain graph`` / ``validate`` show (:func:`shard_plan`), with no process group."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

from torch import nn

from ...comm.zero import FlatShard
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel

LEVELS = {"optimizer": 1, "gradients": 2, "parameters": 3}


def check_shard(job: JobConfig, s: DataParallel) -> None:
    """ZeRO (``strategy.shard``) shards what AllReduce would all-reduce: uncompressed only."""
    if s.shard == "none":
        if s.shard_unit is not None:
            raise ConfigError([("strategy.shard_unit", "is the unit of shard = \"gradients\" or "
                                "\"parameters\" (this job does not shard)")])
        return
    if s.aggregation.method != "AllReduce":
        raise ConfigError([("strategy.shard", (
            f"shard = {s.shard!r} shards AllReduce's exchange; aggregation "
            f"{s.aggregation.method} has none (use AllReduce, or shard = \"none\")"))])
    if job.compression is not None and job.compression.method != "None":
        raise ConfigError([("strategy.shard", (
            f"shard = {s.shard!r} with [compression] {job.compression.method} is not supported: "
            "a compressed exchange all-reduces (or all-gathers) whole gradients and keeps whole "
            "error-feedback residuals per rank, which sharding would not shrink; drop one of them"))])
    if s.shard_unit is not None and s.shard == "optimizer":
        raise ConfigError([("strategy.shard_unit", (
            "is the unit of shard = \"gradients\" / \"parameters\" (reduce-scattered, and "
            "gathered, unit by unit); shard = \"optimizer\" all-reduces whole gradients"))])


def resolve_units(net: nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The module paths gathered as units: those matching a glob of ``patterns`` or whose
    class name is one (None: each direct child); ConfigError for a pattern matching none."""
    if patterns is None:
        return [n for n, _ in net.named_children()]
    out: list[str] = []
    for pat in patterns:
        hits = [n for n, m in net.named_modules() if n and (fnmatch.fnmatchcase(n, pat)
                                                              or type(m).__name__ == pat)]
        if not hits:
            raise ConfigError([("strategy.shard_unit", (
                f"{pat!r} matches no module path or class name of the model (children: "
                f"{', '.join(n for n, _ in net.named_children())})"))])
        out += [h for h in hits if h not in out]
    return out


def assign_units(net: nn.Module, paths: Sequence[str], shared: Sequence[tuple[str, nn.Parameter]]
            ) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Each shared parameter to the deepest unit holding it when the units holding it are
    nested; to the root (``""``, last) when none or several sibling units use it (a tie)."""
    holders: dict[int, list[str]] = {}
    for path in paths:
        for _, p in net.get_submodule(path).named_parameters(remove_duplicate=False):
            if path not in holders.setdefault(id(p), []):
                holders[id(p)].append(path)
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {path: [] for path in paths}
    groups[""] = []
    for n, p in shared:
        hs = sorted(holders.get(id(p), []), key=len)
        nested = all(hs[-1] == h or hs[-1].startswith(h + ".") for h in hs)
        groups[hs[-1] if hs and nested else ""].append((n, p))
    return [(path, named) for path, named in groups.items() if named]


def shard_plan(net: nn.Module, *, level: str, units: Sequence[str] | None, local: set[str],
               world: int) -> dict[str, Any]:
    """What ``shard = level`` on ``world`` replicas shards, without processes (``paratrain
    graph`` / ``validate``): each unit's parameters and elements, the elements of one rank's
    shard (rank 0's, the largest), the parameters kept whole, and the bytes a rank holds
    for fp32 Adam by the ZeRO formula."""
    shared = [(n, p) for n, p in net.named_parameters() if p.requires_grad and n not in local]
    paths = resolve_units(net, units) if LEVELS[level] >= 2 else []
    out: dict[str, Any] = {"level": level, "zero_stage": LEVELS[level], "replicas": world, "units": []}
    for path, named in assign_units(net, paths, shared):
        flat = FlatShard([p.shape for _, p in named], world=world, rank=0)
        out["units"].append({"unit": path or "(root)", "parameters": [n for n, _ in named],
                             "elements": sum(p.numel() for _, p in named),
                             "elements_per_rank": flat.numel})
    out["whole"] = sorted(n for n, p in net.named_parameters() if n in local or not p.requires_grad)
    n_shared = sum(p.numel() for _, p in shared)
    per = {1: 8 + 8 / world, 2: 4 + 12 / world, 3: 16 / world}[LEVELS[level]]
    out["adam_fp32_bytes_per_rank"] = int(per * n_shared + 16 * sum(
        p.numel() for n, p in net.named_parameters() if n in local))
    return out
