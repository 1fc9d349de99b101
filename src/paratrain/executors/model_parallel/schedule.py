"""Pipeline schedules as pure functions: the order of forward/backward micro-batch steps.

An :data:`Action` ``(kind, micro, segment)``: ``F`` a forward, ``B`` the backward (under a
zero-bubble schedule only the input gradients), ``W`` the weight gradients ``B`` left. With
``p`` stages and ``m`` micro-batches:

- **GPipe** (Huang et al. 2019): all ``m`` forwards, then all backwards.
- **1F1B / PipeDream-Flush** (Narayanan et al. 2021): stage ``s`` runs ``min(p - s - 1, m)``
  warm-up forwards, then alternates one forward and one backward, then drains; it holds at
  most ``min(p - s, m)`` micro-batches.
- **Interleaved 1F1B** (Narayanan et al. 2021, §2.2): rank ``r`` owns chunks ``r, r + p, ..``
  of ``v p``; micro-batches go in ``max(1, m // p)`` groups of at least ``p`` (larger first),
  each group's forwards chunk by chunk (backwards reversed) after ``2(p - r - 1) + (v - 1) g_0``
  warm-up forwards. Bubble ``(p - 1) / (v m + p - 1)`` for ``m >= p`` (Megatron's order when
  ``p`` divides ``m``).
- **ZB-H1** (Qi et al. 2024, §3.1): 1F1B's ``min(p - r, m)`` warm-up, then ``B_i, W_{i-r},
  F_{i+p-r}``; the remaining ``W`` last. Peak ``min(p, m)`` micro-batches; with ``F = B = W``
  the bubble is ``(p - 1) / (3 m + p - 1)`` for ``m >= p``.

:func:`simulate` replays per-rank orders with step costs over the dependencies of a chain
(``F(i,s) <- F(i,s-1)``, ``B(i,s) <- B(i,s+1), F(i,s)``, ``W(i,s) <- B(i,s)``) and detects
deadlock, which does not depend on the costs: orders that replay here run on real ranks with
blocking receives. :func:`sequential` is Direct/DataStore's order: forwards by segment,
backwards reversed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Action = tuple[Literal["F", "B", "W"], int, int]
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1")
#: schedules whose backward is split into B (input gradients) and W (weight gradients)
SPLIT_BACKWARD = frozenset({"ZBH1"})
#: schedules where a rank owns ``virtual_stages`` chunks
VIRTUAL = frozenset({"Interleaved1F1B"})


def _check(stage: int, num_stages: int, num_micro: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if num_micro < 1:
        raise ValueError(f"need at least one micro-batch (got {num_micro})")


def gpipe(stage: int, num_stages: int, num_micro: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order)."""
    _check(stage, num_stages, num_micro)
    return [("F", i, stage) for i in range(num_micro)] + [("B", i, stage) for i in range(num_micro)]


def one_f_one_b(stage: int, num_stages: int, num_micro: int) -> list[Action]:
    """Warm-up ``min(p-s-1, m)`` forwards, steady 1F1B, cool-down backwards."""
    _check(stage, num_stages, num_micro)
    warm = min(num_stages - stage - 1, num_micro)
    out: list[Action] = [("F", i, stage) for i in range(warm)]
    for j in range(num_micro - warm):
        out.append(("F", warm + j, stage))
        out.append(("B", j, stage))
    out.extend(("B", i, stage) for i in range(num_micro - warm, num_micro))
    return out


def interleaved_1f1b(stage: int, num_stages: int, num_micro: int, virtual_stages: int) -> list[Action]:
    """Rank ``stage``'s interleaved order over its segments ``stage + c p`` (module docstring)."""
    _check(stage, num_stages, num_micro)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1 (got {virtual_stages})")
    if virtual_stages == 1:
        return one_f_one_b(stage, num_stages, num_micro)
    p, v = num_stages, virtual_stages
    groups = max(1, num_micro // p)  # each of at least min(p, m) micro-batches, larger first
    base, rest = divmod(num_micro, groups)
    sizes = [base + 1] * rest + [base] * (groups - rest)

    def steps(backward: bool) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        start = 0
        for n in sizes:
            for c in range(v):
                chunk = v - 1 - c if backward else c
                out.extend((start + j, chunk * p + stage) for j in range(n))
            start += n
        return out

    fwd, bwd = steps(False), steps(True)
    total = num_micro * v
    warm = min(total, 2 * (p - stage - 1) + (v - 1) * sizes[0])
    order: list[Action] = [("F", i, s) for i, s in fwd[:warm]]
    for k in range(total - warm):
        order.append(("F", *fwd[warm + k]))
        order.append(("B", *bwd[k]))
    order.extend(("B", i, s) for i, s in bwd[total - warm:])
    return order


def zb_h1(stage: int, num_stages: int, num_micro: int) -> list[Action]:
    """ZB-H1: 1F1B's warm-up, then ``B_i, W_{i-stage}, F_{i+p-stage}``; leftover ``W`` last."""
    _check(stage, num_stages, num_micro)
    warm = min(num_stages - stage, num_micro)
    order: list[Action] = [("F", i, stage) for i in range(warm)]
    done_w = 0
    for i in range(num_micro):
        order.append(("B", i, stage))
        if i >= stage:
            order.append(("W", i - stage, stage))
            done_w += 1
        if i + warm < num_micro:
            order.append(("F", i + warm, stage))
    order.extend(("W", j, stage) for j in range(done_w, num_micro))
    return order


def schedule(name: str, stage: int, num_stages: int, num_micro: int,
             virtual_stages: int = 1) -> list[Action]:
    """The named schedule for rank ``stage`` (its position among the pipeline's ranks)."""
    if name == "Interleaved1F1B":
        return interleaved_1f1b(stage, num_stages, num_micro, virtual_stages)
    orders = {"GPipe": gpipe, "1F1B": one_f_one_b, "ZBH1": zb_h1}
    if name not in orders:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return orders[name](stage, num_stages, num_micro)


def sequential(segments: Sequence[int], num_micro: int = 1) -> list[Action]:
    """Unpipelined order for one rank owning ``segments``: F by segment, B reversed."""
    segs = sorted(segments)
    fwd: list[Action] = [("F", i, s) for i in range(num_micro) for s in segs]
    bwd: list[Action] = [("B", i, s) for i in range(num_micro) for s in reversed(segs)]
    return fwd + bwd


def micro_batch_sizes(batch: int, micro_batch_size: int) -> list[int]:
    """Row counts of the micro-batches of a ``batch``-row batch (the last may be smaller)."""
    if batch < 1 or micro_batch_size < 1:
        raise ValueError(f"batch ({batch}) and micro_batch_size ({micro_batch_size}) must be >= 1")
    full, rest = divmod(batch, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def theoretical_bubble(num_stages: int, num_micro: int, name: str = "1F1B",
                       virtual_stages: int = 1) -> float:
    """Idle fraction of an ideal step (equal stage times, free communication):
    GPipe/1F1B ``(p-1)/(m+p-1)``; Interleaved1F1B ``(p-1)/(v m+p-1)``; ZBH1 with
    ``F = B = W`` ``(p-1)/(3m+p-1)``. The last two hold for ``m >= p``."""
    p, m = num_stages, num_micro
    if name == "Interleaved1F1B":
        return (p - 1) / (virtual_stages * m + p - 1)
    if name == "ZBH1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


@dataclass(frozen=True)
class SimResult:
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    finish: dict[Action, float]

    @property
    def bubble(self) -> float:
        """Mean idle fraction over ranks."""
        p = len(self.busy)
        return sum(1.0 - b / self.makespan for b in self.busy) / p


def _deps(action: Action, last: int) -> list[Action]:
    kind, i, s = action
    if kind == "F":
        return [("F", i, s - 1)] if s > 0 else []
    if kind == "B":
        deps: list[Action] = [("F", i, s)]
        return deps + [("B", i, s + 1)] if s < last else deps
    return [("B", i, s)]


def simulate(orders: Sequence[Sequence[Action]], *, t_f: float = 1.0, t_b: float = 1.0,
             t_w: float = 1.0, costs: Mapping[Action, float] | None = None) -> SimResult:
    """Replay per-rank action orders (rank ``r`` = ``orders[r]``) over segments ``0..P-1``: an
    action starts when its rank is free and its dependencies (module docstring) are done,
    taking ``t_f``/``t_b``/``t_w`` or its ``costs`` entry (measured, to replay a real step);
    a micro-batch is in flight from its ``F`` to its ``W`` (or ``B``). A ``RuntimeError`` on
    deadlock, a duplicate step, a segment split over ranks or a step no rank runs.
    """
    p = len(orders)
    where: dict[int, int] = {}
    for r, order in enumerate(orders):
        if len(set(order)) != len(order):
            raise RuntimeError(f"rank {r}: duplicate step in {order}")
        for _, _, s in order:
            if where.setdefault(s, r) != r:
                raise RuntimeError(f"segment {s} is scheduled on ranks {where[s]} and {r}")
    want = {a for order in orders for a in order}
    last = max(where, default=0)
    has_w = {(i, s) for k, i, s in want if k == "W"}
    pos = [0] * p
    clock = [0.0] * p
    finish: dict[Action, float] = {}
    in_flight = [0] * p
    peak = [0] * p
    busy = [0.0] * p
    step_cost = {"F": t_f, "B": t_b, "W": t_w}
    while len(finish) < len(want):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                action = orders[r][pos[r]]
                kind, i, s = action
                deps = _deps(action, last)
                if any(d not in finish for d in deps):
                    if any(d not in want for d in deps):
                        raise RuntimeError(f"rank {r}: {kind}{i} of segment {s} depends on a step no rank runs")
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                cost = costs[action] if costs is not None else step_cost[kind]
                clock[r] = start + cost
                busy[r] += cost
                finish[action] = clock[r]
                if kind == "F":
                    in_flight[r] += 1
                elif kind == "W" or (i, s) not in has_w:
                    in_flight[r] -= 1
                peak[r] = max(peak[r], in_flight[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise RuntimeError(f"schedule deadlocks; ranks wait at {stuck}")
    return SimResult(max(clock), busy, peak, finish)
