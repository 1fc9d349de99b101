"""PopulationBased's ``summary.json``: the best member (its fitness, hyperparameters and the
schedule that produced its weights), the population's final fitness, copies, failures
(first failures included) and this process's timing of the generation loop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ...config.job import JobConfig
from .failures import first_failures
from .pbt import PopulationState, ancestry

__all__ = ["NOT_TEST", "population_summary"]

NOT_TEST = frozenset({"train_loss", "steps", "batch_size"})  # member metrics not of the test set


def population_summary(
    job: JobConfig, pop: PopulationState, run_dir: Path, world: int, started: float,
    timing: dict[str, float], per_rank: list[dict[str, float]], *, metric: str, mode: str,
    task: Any, reference: dict[str, float],
) -> dict[str, Any]:
    opts = job.population
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
        "task": str(getattr(task, "name", type(task).__name__)),
        "metric": metric,
        "mode": mode,
        "evolve": opts.evolve,
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
        "first_failures": first_failures(pop),
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
