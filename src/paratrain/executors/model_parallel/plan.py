"""ModelParallel placement: which rank runs which node, and the model cut into parts.

Each :class:`~paratrain.config.strategy.Partition` claims module paths of the traced model
(:func:`paratrain.graph.trace`) for a worker; unclaimed modules run on rank 0 (DESIGN §4;
docs/model-parallel.md); the graph is then cut into *parts* (:func:`paratrain.graph.partition.cut`).
Direct and DataStore take any placement; ``Interleaved1F1B`` needs ``v`` parts per rank placed
round-robin; any other Pipeline one part per rank. Every user error is a ConfigError whose
field names the partition.

A ``DataParallel{num_replicas}`` subgraph replicates a stage (:func:`replicas_for`): it must
cover whole parts of one worker; that worker and the first ``R - 1`` workers that own no part
run the same part, each on its share of every micro-batch's rows (:func:`row_bounds`,
``tensor_split``'s rule), and sum the stage's gradients after the step's last backward. Each
replica's loss is weighted by its rows (``n_ij / B``), so the step equals the unreplicated
model's (PipeDream's replicated stages, Narayanan et al. 2019). A value crossing into or out
of a replicated stage is cut by rows: a sender holding ``[a, b)`` sends a receiver holding
``[c, d)`` the rows ``[max(a, c), min(b, d))`` (:func:`pieces`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...comm.context import resolve_rank
from ...config import ConfigError
from ...graph import trace
from ...graph.partition import DEFAULT_RANK, Cut, Part, cut
from ...subgraphs import under

FIELD = "strategy.partitions"


@dataclass(frozen=True)
class Plan:
    """Every module's rank (``owner``) and the model cut into parts (``segments``, in order)."""

    nodes: tuple[str, ...]
    owner: dict[str, int]
    cut: Cut
    claims: dict[str, int]  # claimed module path -> rank

    @property
    def segments(self) -> tuple[Part, ...]:
        return self.cut.parts

    @property
    def num_segments(self) -> int:
        return len(self.cut.parts)

    def segments_of(self, rank: int) -> list[Part]:
        return self.cut.parts_of(rank)

    @property
    def last_rank(self) -> int:
        """The rank that holds the model's output (computes the loss)."""
        return self.cut.loss_rank

    def is_contiguous(self) -> bool:
        """True when every rank owns exactly one part (a pipeline)."""
        return len(self.cut.ranks()) == len(self.cut.parts)


def _claims(model: nn.Module, called: Sequence[str], ran: set[str], partitions: Sequence[Any],
            workers: Sequence[Any]) -> dict[str, int]:
    """Validate the partitions against the model's modules; module path -> rank."""
    problems: list[tuple[str, str]] = []
    modules = [n for n, _ in model.named_modules() if n]
    known = set(modules)
    called_set = set(called)
    listed = ", ".join(called) if len(called) <= 60 else ", ".join(called[:60]) + ", ..."
    claimed: dict[str, int] = {}
    claims: dict[str, int] = {}
    for i, part in enumerate(partitions):
        where = f"{FIELD}[{i}]"
        if not part.node_ids:
            problems.append((f"{where}.node_ids", f"partition {i} is empty: it claims no node"))
        try:
            rank: int | None = resolve_rank(part.target, workers, field=f"{where}.target")
        except ConfigError as e:
            problems.extend(e.problems)
            rank = None
        for node in part.node_ids:
            if node not in known:
                problems.append((f"{where}.node_ids", f"partition {i} claims {node!r}, which is "
                                 f"not in this model; its nodes are: {listed}"))
                continue
            if node in claimed:
                first = claimed[node]
                msg = (f"{node!r} is listed twice in partition {i}" if first == i else
                       f"{node!r} is claimed by partitions {first} and {i}; a node runs in one place")
                problems.append((f"{where}.node_ids", msg))
                continue
            inside = next((c for c in called_set if node.startswith(c + ".")), None)
            if inside is not None:
                problems.append((f"{where}.node_ids", (
                    f"partition {i} claims {node!r}, which is inside {inside!r}: that module is "
                    f"traced as one node (a leaf), so its parts cannot be placed apart; claim "
                    f"{inside!r} instead")))
                continue
            if node not in ran and not any(c.startswith(node + ".") for c in ran):
                problems.append((f"{where}.node_ids", (
                    f"partition {i} claims {node!r}, which the model's forward never runs")))
                continue
            claimed[node] = i
            if rank is not None:
                claims[node] = rank
    if problems:
        raise ConfigError(problems)
    return claims


def build_plan(model: nn.Module | Sequence[str], partitions: Sequence[Any], workers: Sequence[Any],
               *, contiguous: bool = False, leaves: Sequence[str] = (),
               example: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Plan:
    """Place ``model``'s nodes by ``partitions`` on ``workers`` and cut it into parts; every
    problem in one ConfigError. ``contiguous`` (Pipeline): one part per rank. ``leaves``:
    module paths traced as one node. ``example``: a batch's ``(args, kwargs)``, with which a
    model fx cannot trace is captured by ``torch.export``. A chain of names (tools, tests)
    stands for identities in order."""
    if not isinstance(model, nn.Module):
        model = nn.Sequential(OrderedDict((n, nn.Identity()) for n in model))
    if not partitions:
        raise ConfigError([(FIELD, "model-parallel training with no partitions: "
                                   "nothing says where any node runs")])
    gm = trace(model, leaves, example)
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    if not called and not any(n.op == "call_function" for n in gm.graph.nodes):
        raise ConfigError([("model", "the model has no nodes to place")])
    ran = set(called)
    for n in gm.graph.nodes:
        for v in (n.meta.get("nn_module_stack") or {}).values():
            ran.add(str(v[0] if isinstance(v, tuple) else v))
    claims = _claims(model, called, ran, partitions, workers)
    c = cut(gm, claims)
    owner: dict[str, int] = {}  # a module's rank: its path's under fx, its first part's exported
    for p in c.parts:
        for m in p.nodes:
            owner.setdefault(m, p.rank)
    plan = Plan(c.call_order, owner, c, dict(claims))
    if contiguous and not plan.is_contiguous():
        problems: list[tuple[str, str]] = []
        for rank in plan.cut.ranks():
            segs = plan.segments_of(rank)
            if len(segs) > 1:
                wid = next((str(w.id) for w in workers if int(w.rank) == rank), f"rank {rank}")
                runs = "; ".join(",".join(s.nodes) or "(ops only)" for s in segs)
                why = " (uncovered nodes run on rank 0)" if rank == DEFAULT_RANK else ""
                later = segs[1]
                need = next((v for v in later.inputs
                             if c.rank_of_value.get(v) not in (None, rank)), None)
                src = c.rank_of_value.get(need) if need else None
                via = ""
                if need is not None and src is not None:
                    by = next((p for p in c.parts if need in p.outputs), None)
                    made = ",".join(by.nodes) if by is not None and by.nodes else "another worker"
                    via = (f"; its later nodes read the output of {made} (rank {src}), which runs "
                           f"after its earlier ones: a cycle between workers in one "
                           f"micro-batch's forward")
                problems.append((FIELD, f"Pipeline needs each worker's nodes to be one contiguous "
                                        f"run, but worker {wid!r} (rank {rank}) owns "
                                        f"{len(segs)} separate runs: {runs}{why}{via} (runs "
                                        f"placed round-robin are chunks for schedule = "
                                        f"\"Interleaved1F1B\")"))
        raise ConfigError(problems)
    return plan


def check_interleaved(plan: Plan, workers: Sequence[Any], virtual_stages: int | None) -> int:
    """The chunks per rank ``v`` of an ``Interleaved1F1B`` placement: ``v p`` parts over ``p``
    ranks, part ``k`` on the rank of part ``k mod p``; else a ConfigError naming each rank's
    parts (also when ``virtual_stages`` is given and differs)."""
    ranks = [part.rank for part in plan.segments]
    p = len(plan.cut.ranks())
    total = len(ranks)
    names = {int(w.rank): str(w.id) for w in workers}

    def runs() -> str:
        return "; ".join(f"{names.get(r, f'rank {r}')}: parts {[k for k, q in enumerate(ranks) if q == r]}"
                         for r in plan.cut.ranks())

    if total % p or any(ranks[k] != ranks[k % p] for k in range(total)):
        raise ConfigError([(FIELD, (
            f"Interleaved1F1B needs the model cut into virtual_stages x {p} workers parts placed "
            f"round-robin (part k on the worker of part k mod {p}), but the partitions make "
            f"{total} parts: {runs()}; list each worker's chunks in turn (e.g. four partitions "
            f"worker-0, worker-1, worker-0, worker-1 for two chunks each)"))])
    v = total // p
    if virtual_stages is not None and virtual_stages != v:
        raise ConfigError([("strategy.communication.virtual_stages", (
            f"virtual_stages = {virtual_stages}, but the partitions place {v} chunk(s) on each of "
            f"the {p} workers ({runs()}); give {virtual_stages * p} partitions round-robin or "
            f"set virtual_stages = {v}"))])
    return v

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
