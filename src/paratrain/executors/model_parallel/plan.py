"""ModelParallel placement: which rank runs which node, as maximal runs ("segments").

A model is a sequence of named nodes ``n_0 .. n_{N-1}`` (``paratrain.graph.nodes``).
Each :class:`~paratrain.config.strategy.Partition` claims some nodes and names a worker
(``{"WorkerId": id}`` = exactly that worker, ``{"Tag": t}`` = the first worker by rank
carrying ``t``). Nodes no partition claims run on rank 0 (DESIGN §4). The placement
``owner: node -> rank`` is then cut into *segments*: maximal runs of consecutive nodes
with the same owner, ``S_0 .. S_{k-1}``, so that ``S_j``'s output is ``S_{j+1}``'s input
and consecutive segments always live on different ranks (activations move forward
``owner(S_j) -> owner(S_{j+1})``, gradients the other way).

``Direct`` and ``DataStore`` accept any placement (a rank may own several non-adjacent
segments). ``Pipeline`` needs one segment per rank (each worker's nodes contiguous):
segment index = pipeline stage index, as in GPipe (Huang et al. 2019) and
PipeDream-Flush/1F1B (Narayanan et al. 2021).

Every user error is a :class:`~paratrain.config.ConfigError` whose field path names the
partition and whose message names the node or target at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...comm.workers import resolve_rank
from ...config import ConfigError

__all__ = ["Segment", "Plan", "build_plan", "resolve_target", "DEFAULT_RANK"]

DEFAULT_RANK = 0


@dataclass(frozen=True)
class Segment:
    """A maximal run of consecutive nodes placed on one rank."""

    index: int
    rank: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """The placement of every node and its cut into segments (in graph order)."""

    nodes: tuple[str, ...]
    owner: dict[str, int]
    segments: tuple[Segment, ...]

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def segments_of(self, rank: int) -> list[Segment]:
        return [s for s in self.segments if s.rank == rank]

    def ranks(self) -> list[int]:
        """Ranks that own at least one node, in order of first appearance."""
        seen: list[int] = []
        for s in self.segments:
            if s.rank not in seen:
                seen.append(s.rank)
        return seen

    @property
    def last_rank(self) -> int:
        """The rank that owns the model's output (computes the loss)."""
        return self.segments[-1].rank

    def is_contiguous(self) -> bool:
        """True when every rank owns exactly one segment (a pipeline)."""
        ranks = [s.rank for s in self.segments]
        return len(ranks) == len(set(ranks))


def resolve_target(target: Any, workers: Sequence[Any], *, field: str = "target") -> int:
    """Rank of the worker ``target`` names (``paratrain.comm.workers``); a ConfigError at
    ``field`` listing the registered ids (or tags) when no worker answers to it."""
    return resolve_rank(target, workers, field=field)


def build_plan(
    node_names: Sequence[str],
    partitions: Sequence[Any],
    workers: Sequence[Any],
    *,
    contiguous: bool = False,
    field: str = "strategy.partitions",
) -> Plan:
    """Place ``node_names`` by ``partitions`` on ``workers``; cut into segments.

    ``contiguous=True`` (Pipeline) additionally requires every rank's nodes to be one run.
    All problems found are reported together in one ConfigError.
    """
    names = list(node_names)
    if not names:
        raise ConfigError([("model", "the model has no nodes to place")])
    if not partitions:
        raise ConfigError([(field, "model-parallel training with no partitions: "
                                   "nothing says where any node runs")])
    problems: list[tuple[str, str]] = []
    known = set(names)
    claimed: dict[str, int] = {}
    owner: dict[str, int] = {}
    for i, part in enumerate(partitions):
        where = f"{field}[{i}]"
        if not part.node_ids:
            problems.append((f"{where}.node_ids", f"partition {i} is empty: it claims no node"))
        try:
            rank: int | None = resolve_target(part.target, workers, field=f"{where}.target")
        except ConfigError as e:
            problems.extend(e.problems)
            rank = None
        for node in part.node_ids:
            if node not in known:
                problems.append((f"{where}.node_ids", f"partition {i} claims {node!r}, which is "
                                 f"not in this model; its nodes are: {', '.join(names)}"))
            elif node in claimed:
                first = claimed[node]
                msg = (f"{node!r} is listed twice in partition {i}" if first == i else
                       f"{node!r} is claimed by partitions {first} and {i}; a node runs in one place")
                problems.append((f"{where}.node_ids", msg))
            else:
                claimed[node] = i
                if rank is not None:
                    owner[node] = rank
    if problems:
        raise ConfigError(problems)
    for node in names:
        owner.setdefault(node, DEFAULT_RANK)
    segments: list[Segment] = []
    run: list[str] = []
    for node in names:
        if run and owner[run[-1]] != owner[node]:
            segments.append(Segment(len(segments), owner[run[-1]], tuple(run)))
            run = []
        run.append(node)
    segments.append(Segment(len(segments), owner[run[-1]], tuple(run)))
    plan = Plan(tuple(names), owner, tuple(segments))
    if contiguous and not plan.is_contiguous():
        for rank in plan.ranks():
            segs = plan.segments_of(rank)
            if len(segs) > 1:
                wid = next((str(w.id) for w in workers if int(w.rank) == rank), f"rank {rank}")
                runs = "; ".join(",".join(s.nodes) for s in segs)
                why = " (uncovered nodes run on rank 0)" if rank == DEFAULT_RANK else ""
                problems.append((field, f"Pipeline needs each worker's nodes to be one contiguous "
                                        f"run, but worker {wid!r} (rank {rank}) owns "
                                        f"{len(segs)} separate runs: {runs}{why}"))
        raise ConfigError(problems)
    return plan
