"""PopulationBased's failures and ``summary.json``.

A member that fails before it ever saved a state (in generation 0, or sourced from such a
member) has nothing to continue from: every later generation it cannot run reports *its first
failure* (a generation's record carries them as ``lost``, so a resume knows them too), not a
missing-file error that hides it.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from ...config.job import JobConfig
from .hyperparams import task_name
from .pbt import PopulationState, ancestry


def lost_before(pop: PopulationState) -> dict[str, str]:
    """Members with no state after the last recorded generation (str(member) -> the failure
    that left them so, "generation <g>: <error>")."""
    return dict(pop.history[-1].get("lost", {})) if pop.history else {}


def lost_after(ordered: list[dict[str, Any]], lost: dict[str, str], g: int) -> dict[str, str]:
    """:func:`lost_before` after generation ``g``: a member that ends it without state keeps its
    source's first failure, or its own error when its source had state (or none)."""
    out: dict[str, str] = {}
    for r in ordered:
        if not r.get("has_state", True):
            out[str(r["member"])] = lost.get(str(r["source"])) or f"generation {g}: {r['error']}"
    return out


def warn_first_failures(pop: PopulationState, ordered: list[dict[str, Any]],
                         lost: dict[str, str], *, evolve: bool) -> None:
    """Rank 0 warns once per member, at its first failure, with the member's message."""
    failed_before = first_failures(pop.history[:-1])
    for r in ordered:
        i = r["member"]
        if r["error"] and str(i) not in failed_before:
            stays = (" It has no state to continue from; with population.evolve = false it is "
                     "never replaced and fails every later generation."
                     if str(i) in lost and not evolve else "")
            warnings.warn(f"PopulationBased member {i} failed in generation {r['generation']}: "
                          f"{r['error']}.{stays}", RuntimeWarning, stacklevel=2)


def first_failures(history: list[dict[str, Any]]) -> dict[str, str]:
    """Each member that ever failed -> its first failure ("generation <g>: <error>")."""
    out: dict[str, str] = {}
    for rec in history:
        for i, e in enumerate(rec["errors"]):
            if e and str(i) not in out:
                out[str(i)] = f"generation {rec['generation']}: {e}"
    return out


NOT_TEST = frozenset({"train_loss", "steps", "batch_size"})  # member metrics not of the test set


def population_summary(job: JobConfig, pop: PopulationState, run_dir: Path, world: int,
                       started: float, timing: dict[str, float], per_rank: list[dict[str, float]], *,
                       metric: str, mode: str, task: Any, reference: dict[str, float]) -> dict[str, Any]:
    last = pop.history[-1]
    best = pop.best(mode)
    m = last["metrics"][best] or {}
    wall = time.perf_counter() - started
    ckpt = sum(p["checkpoint_s"] for p in per_rank)
    overhead = ckpt + timing["evolve_s"] + timing["persist_s"]
    return {
        "strategy": "PopulationBased",
        "run_dir": str(run_dir),
        "population_size": pop.size,
        "generations": len(pop.history),
        "num_workers": world,
        "task": task_name(task),
        "metric": metric,
        "mode": mode,
        "evolve": job.population.evolve,
        "best_member": best,
        "best_fitness": last["fitness"][best],
        "best_hparams": last["hparams"][best],
        "best_hparams_text": " ".join(f"{k}={_fmt(v)}" for k, v in sorted(last["hparams"][best].items())),
        "best_schedule": ancestry(pop.history, best),
        "final_fitness": last["fitness"],
        "test_loss": m.get("loss"),
        **{f"test_{k}": v for k, v in m.items() if k not in NOT_TEST},
        **reference,
        "parameters_sha256": None,  # the best member's saved model's (the runner's)
        "copies": sum(len(r["copies"]) for r in pop.history),
        "member_steps": sum(int(m["steps"]) for r in pop.history for m in r["metrics"] if m),
        "failures": sum(1 for r in pop.history for e in r["errors"] if e),
        "first_failures": first_failures(pop.history),
        "wall_time_s": round(wall, 3),
        # This process's share only (a resumed run times the generations it ran).
        "timing": {
            "train_s": round(sum(p["train_s"] for p in per_rank), 4),
            "eval_s": round(sum(p["eval_s"] for p in per_rank), 4),
            "checkpoint_s": round(ckpt, 4),
            "evolve_s": round(timing["evolve_s"], 4),
            "persist_s": round(timing["persist_s"], 4),
            "comm_s": round(timing["comm_s"], 4),
            # generation loop only (no process start, imports or data loading)
            "loop_s": round(timing["loop_s"], 4),
            "overhead_s": round(overhead, 4),
            "overhead_fraction": round(overhead / timing["loop_s"], 5) if timing["loop_s"] > 0 else None,
        },
    }


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
