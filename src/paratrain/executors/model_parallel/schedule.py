"""Pipeline schedules as pure functions: the order of forward/backward micro-batch steps.

An :data:`Action` is ``(kind, micro, segment)``: ``("F", i, s)`` runs segment ``s``'s
forward on micro-batch ``i``; ``("B", i, s)`` its backward. With ``p`` stages and ``m``
micro-batches:

- **GPipe** (Huang et al. 2019): every stage runs ``F_0 .. F_{m-1}`` then
  ``B_0 .. B_{m-1}``; a stage holds the activations of all ``m`` micro-batches.
- **1F1B / PipeDream-Flush** (Narayanan et al. 2021, "Efficient Large-Scale Language
  Model Training on GPU Clusters"): stage ``s`` runs ``w = min(p - s - 1, m)`` warm-up
  forwards, then alternates one forward and one backward for ``m - w`` rounds, then
  drains ``w`` backwards; it holds at most ``min(p - s, m)`` micro-batches at a time.

Both have the same ideal bubble fraction ``(p - 1) / (m + p - 1)`` (equal stage times,
free communication). :func:`simulate` replays per-stage orders with fixed step costs and
the data dependencies ``F(i,s) <- F(i,s-1)``, ``B(i,s) <- B(i,s+1)``, ``B(i,s) <- F(i,s)``;
it detects deadlock and reports makespan, bubble and peak in-flight micro-batches.

:func:`sequential` is the unpipelined order of ``Direct``/``DataStore`` for a rank that
may own several non-adjacent segments: forwards in segment order, backwards reversed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Action", "gpipe", "one_f_one_b", "schedule", "sequential", "micro_batch_sizes",
    "theoretical_bubble", "SimResult", "simulate", "SCHEDULES",
]

Action = tuple[Literal["F", "B"], int, int]
SCHEDULES = ("GPipe", "1F1B")


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


def schedule(name: str, stage: int, num_stages: int, num_micro: int) -> list[Action]:
    """The named schedule (``"GPipe"`` or ``"1F1B"``) for one stage."""
    if name == "GPipe":
        return gpipe(stage, num_stages, num_micro)
    if name == "1F1B":
        return one_f_one_b(stage, num_stages, num_micro)
    raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")


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


def theoretical_bubble(num_stages: int, num_micro: int) -> float:
    """Idle fraction of an ideal GPipe/1F1B step: ``(p - 1) / (m + p - 1)``."""
    return (num_stages - 1) / (num_micro + num_stages - 1)


@dataclass(frozen=True)
class SimResult:
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    finish: dict[Action, float]

    @property
    def bubble(self) -> float:
        """Mean idle fraction over stages."""
        p = len(self.busy)
        return sum(1.0 - b / self.makespan for b in self.busy) / p


def simulate(orders: Sequence[Sequence[Action]], *, t_f: float = 1.0, t_b: float = 1.0,
             costs: Mapping[Action, float] | None = None) -> SimResult:
    """Run per-stage action orders (stage ``s`` = ``orders[s]``, segments ``0..p-1``).

    Each stage executes its list in order; an action starts when the stage is free and
    its dependencies have finished (communication is free). An action takes ``t_f`` or
    ``t_b``, or its own time from ``costs`` (e.g. measured, to replay a real step).
    Raises ``RuntimeError`` on deadlock (no stage can make progress) or on a
    missing/duplicate step.
    """
    p = len(orders)
    want = {(k, i, s) for s, order in enumerate(orders) for (k, i, _) in order}
    for s, order in enumerate(orders):
        if len(set(order)) != len(order) or any(a[2] != s for a in order):
            raise RuntimeError(f"stage {s}: duplicate step or wrong segment in {order}")
    pos = [0] * p
    clock = [0.0] * p
    finish: dict[Action, float] = {}
    in_flight = [0] * p
    peak = [0] * p
    busy = [0.0] * p
    total = sum(len(o) for o in orders)
    while len(finish) < total:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i, _ = orders[s][pos[s]]
                deps: list[Action] = []
                if kind == "F" and s > 0:
                    deps.append(("F", i, s - 1))
                if kind == "B":
                    deps.append(("F", i, s))
                    if s < p - 1:
                        deps.append(("B", i, s + 1))
                if any(d not in finish for d in deps):
                    if any(d not in want for d in deps):
                        raise RuntimeError(f"stage {s}: {kind}{i} depends on a step no stage runs")
                    break
                start = max([clock[s]] + [finish[d] for d in deps])
                cost = costs[orders[s][pos[s]]] if costs is not None else (t_f if kind == "F" else t_b)
                clock[s] = start + cost
                busy[s] += cost
                finish[(kind, i, s)] = clock[s]
                in_flight[s] += 1 if kind == "F" else -1
                peak[s] = max(peak[s], in_flight[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][pos[s]] for s in range(p) if pos[s] < len(orders[s])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    return SimResult(max(clock), busy, peak, finish)
