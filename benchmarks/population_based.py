"""PopulationBased benchmark: PBT overhead and 2-worker vs 1-worker throughput.

Measured in one run, on digits with an MLP, ``population_size`` members, one epoch per
member per generation (four with the full budget: about 170 optimizer steps per
member per generation, still far below a typical PBT generation):

- **overhead fraction** = (restore + save of member checkpoints on the busiest rank,
  exploit/explore, population checkpoint and lineage) / generation-loop wall time, for
  the 1-worker run (goal < 5%);
- **throughput** = member optimizer steps per second of generation loop, 2 workers vs 1
  (goal >= 1.7x on 2 idle cores); the end-to-end ratio including process start is
  reported too.

Every worker (and the in-process 1-worker peer) uses one torch thread. Prints one JSON
object; medians over ``--repeats`` runs (``--quick``: 1 repeat, smaller
budget; ``--smoke``: 1 repeat of 4 tiny members for 2 generations, every code path).
Every figure is measured (timed or counted in this run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance  # noqa: E402


def _job(out: str, name: str, workers: int, *, population: int, generations: int,
         hidden: list[int], seed: int, epochs: int = 1) -> Any:
    from paratrain.config.job import load_job

    return load_job({
        "run": {"name": name, "seed": seed, "output_dir": out, "num_workers": workers},
        "model": {"name": "mlp", "hidden": hidden},
        "train": {"batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.1}},
        "strategy": {
            "type": "PopulationBased", "population_size": population, "generations": generations,
            "exploit": {"method": "Truncation", "fraction": 0.25},
            "explore": {"method": "Perturbation", "factor": 0.2},
        },
        "population": {"epochs_per_generation": epochs},
        "search_space": {
            "lr": {"type": "log_uniform", "low": 1e-3, "high": 0.3},
            "momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
            "weight_decay": {"type": "log_uniform", "low": 1e-6, "high": 1e-2},
        },
    })


def _once(out: str, name: str, workers: int, **kw: Any) -> dict[str, Any]:
    from paratrain.executors.population_based import runner as population

    t = time.perf_counter()
    s = population.run(_job(out, name, workers, **kw))
    end_to_end = time.perf_counter() - t
    tm = s["timing"]
    return {
        "end_to_end_s": end_to_end,
        "loop_s": tm["loop_s"],
        "overhead_fraction": tm["overhead_fraction"],
        "overhead_s": tm["overhead_s"],
        "steps_per_s": s["member_steps"] / tm["loop_s"],
        "steps_per_s_end_to_end": s["member_steps"] / end_to_end,
        "checkpoint_s": tm["checkpoint_s"],
        "evolve_s": tm["evolve_s"],
        "persist_s": tm["persist_s"],
        "best_fitness": s["best_fitness"],
        "parameters_sha256": s["parameters_sha256"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, smaller budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="1 repeat, 4 members of a 16-wide MLP, "
                    "2 generations: every code path")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick or args.smoke else args.repeats
    kw: dict[str, Any] = {
        "population": 4 if args.quick else 8,
        "generations": 3 if args.quick else 5,
        "hidden": [128, 128] if args.quick else [256, 256],
        "epochs": 1 if args.quick else 4,
        "seed": 0,
    }
    if args.smoke:
        kw.update(population=4, generations=2, hidden=[16], epochs=1)
    import torch

    # Worker processes run one torch thread each; the in-process 1-worker peer does too,
    # so the ratio measures scaling over processes, not intra-op threads.
    torch.set_num_threads(1)
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as out:
        for r in range(repeats):
            for w in (1, 2):
                runs[w].append(_once(out, f"bench_w{w}_{r}", w, **kw))

    def med(w: int, key: str) -> float:
        return float(statistics.median(x[key] for x in runs[w]))

    same = len({x["parameters_sha256"] for w in (1, 2) for x in runs[w]}) == 1
    result = {
        "benchmark": "population_based",
        "config": {**kw, "repeats": repeats,
                   "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "overhead_fraction_1_worker": round(med(1, "overhead_fraction"), 4),
        "overhead_fraction_2_workers": round(med(2, "overhead_fraction"), 4),
        "overhead_goal": "< 0.05",
        "overhead_breakdown_1_worker_s": {
            k: round(med(1, k), 4) for k in ("checkpoint_s", "evolve_s", "persist_s", "loop_s")
        },
        "steps_per_s_1_worker": round(med(1, "steps_per_s"), 1),
        "steps_per_s_2_workers": round(med(2, "steps_per_s"), 1),
        "throughput_ratio_2_vs_1": round(med(2, "steps_per_s") / med(1, "steps_per_s"), 3),
        "throughput_goal": ">= 1.7",
        "end_to_end_s_1_worker": round(med(1, "end_to_end_s"), 2),
        "end_to_end_s_2_workers": round(med(2, "end_to_end_s"), 2),
        "end_to_end_ratio_2_vs_1": round(med(1, "end_to_end_s") / med(2, "end_to_end_s"), 3),
        "best_fitness": round(med(1, "best_fitness"), 4),
        "identical_result_1_vs_2_workers": same,
        "note": "ratios are of medians over repeats",
    }
    result["provenance"] = provenance(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
