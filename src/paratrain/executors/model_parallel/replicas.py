"""Replicated stages: a ``DataParallel{num_replicas}`` subgraph under ModelParallel.

The subgraph must cover whole parts of one worker; that worker and the first ``R - 1``
workers that own no part run the same part, each on its share of every micro-batch's rows
(:func:`row_bounds`, ``tensor_split``'s rule), and sum the stage's gradients after the step's
last backward. Each replica's loss is weighted by its rows (``n_ij / B``), so the step equals
the unreplicated model's (PipeDream's replicated stages, Narayanan et al. 2019). Values
crossing into or out of a replicated stage are cut by rows: a sender holding ``[a, b)``
sends a receiver holding ``[c, d)`` the rows ``[max(a, c), min(b, d))`` (:func:`pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...config import ConfigError
from ...graph.partition import DEFAULT_RANK
from ...subgraphs import under
from .plan import Plan

MAX_REPLICAS = 8


def row_bounds(n: int, r: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``r`` replicas' rows of an ``n``-row micro-batch."""
    q, rem = divmod(n, r)
    out, a = [], 0
    for j in range(r):
        b = a + q + (1 if j < rem else 0)
        out.append((a, b))
        a = b
    return out


def pieces(n: int, senders: int, receivers: int) -> list[tuple[int, int, int, int]]:
    """``(sender j, receiver k, start, stop)`` of every non-empty overlap of sender ``j``'s
    rows with receiver ``k``'s, for an ``n``-row micro-batch (rows of the whole micro-batch)."""
    out = []
    for j, (a, b) in enumerate(row_bounds(n, senders)):
        for k, (c, d) in enumerate(row_bounds(n, receivers)):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append((j, k, lo, hi))
    return out


@dataclass(frozen=True)
class Replicas:
    """Physical ranks of each stage's replicas (primary first); an unreplicated stage's
    only replica is its own rank. ``paths``: the subgraph that asked for each."""

    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)

    def of(self, rank: int) -> tuple[int, ...]:
        return self.groups.get(rank, (rank,))

    def count(self, rank: int) -> int:
        return len(self.of(rank))

    def logical(self, physical: int) -> tuple[int, int]:
        """``(stage rank, replica index)`` of a physical rank."""
        for rank, ranks in self.groups.items():
            if physical in ranks:
                return rank, ranks.index(physical)
        return physical, 0


def extra_workers(job: Any) -> int:
    """Workers the replicated stages add beyond their primaries."""
    if getattr(job.strategy, "type", None) != "ModelParallel":
        return 0
    return sum(int(s.num_replicas) - 1 for s in (getattr(job, "subgraphs", None) or {}).values()
               if getattr(s, "type", None) == "DataParallel")


def replicas_for(job: Any, plan: Plan, world: int) -> Replicas:
    """The replica groups the job's DataParallel subgraphs ask for (ConfigErrors name the
    ``subgraphs.<path>`` at fault)."""
    subs = {k: v for k, v in (getattr(job, "subgraphs", None) or {}).items()
            if getattr(v, "type", None) == "DataParallel"}
    if not subs:
        return Replicas()
    used = set(plan.cut.ranks())
    spare = [r for r in range(world) if r not in used]
    groups: dict[int, tuple[int, ...]] = {}
    paths: dict[int, str] = {}
    problems: list[tuple[str, str]] = []
    for path, strat in subs.items():
        where = f"subgraphs.{path}"
        r = int(strat.num_replicas)
        inside = [c for c in plan.claims if under(c, [path])]
        ranks = {plan.claims[c] for c in inside}
        if not inside or len(ranks) != 1:
            problems.append((where, (
                "a replicated stage must cover whole partitions of one worker, but "
                + (f"no partition claims a module under {path!r}" if not inside else
                   f"the modules under {path!r} are claimed for ranks {sorted(ranks)}"))))
            continue
        rank = ranks.pop()
        outside = [c for c, r in plan.claims.items() if r == rank and not under(c, [path])]
        if outside or rank == DEFAULT_RANK or not plan.segments_of(rank):
            why = (f"rank {rank} also runs {outside[0]!r}, outside {path!r}" if outside else
                   f"rank {rank} also runs every module no partition claims" if rank == DEFAULT_RANK
                   else f"rank {rank} runs nothing")
            problems.append((where, f"a replicated stage is a whole worker's part, but {why}"))
            continue
        method = getattr(getattr(strat, "aggregation", None), "method", "AllReduce")
        if method != "AllReduce":
            problems.append((f"{where}.aggregation.method", (
                f"a replicated stage sums its replicas' gradients with one all-reduce per step; "
                f"{method!r} is not supported here (use AllReduce)")))
            continue
        if getattr(strat, "shard_unit", None) is not None:
            problems.append((f"{where}.shard_unit", (
                "a replicated pipeline stage is sharded as one unit (gathered once a step, "
                "reduce-scattered after the step's last backward); remove shard_unit")))
            continue
        if not 1 <= r <= MAX_REPLICAS:
            problems.append((f"{where}.num_replicas", f"1 to {MAX_REPLICAS} replicas (got {r})"))
            continue
        if len(spare) < r - 1:
            problems.append((f"{where}.num_replicas", (
                f"{r} replicas need {r - 1} worker(s) that own no partition, but only "
                f"{len(spare)} is free of the {world} workers; add [[workers]]")))
            continue
        groups[rank] = (rank, *spare[: r - 1])
        paths[rank] = path
        spare = spare[r - 1:]
    if problems:
        raise ConfigError(problems)
    return Replicas(groups, paths)
