"""Replicated pipeline stage: step time with the heavy stage on 2 workers vs on 1.

The job is ``examples/pipeline_replicated_stage.toml``: a 2-stage pipeline (1F1B, 4
micro-batches of 16 rows) whose second stage (``back``: 2 residual blocks, width 256) is
twice as heavy as the first (1 block). Run twice in this process, interleaved ``--repeats``
times, for the same number of optimizer steps on the same data:

- ``replicated``: as the file says, ``[subgraphs.back] DataParallel{num_replicas = 2}``,
  3 workers;
- ``unreplicated``: the same job without the subgraph, 2 workers.

Reported (measured): each run's median optimizer-step time (the loop's own timer on rank 0),
the median over repeats, and ``step_ratio = replicated / unreplicated`` (< 1: replication
helps). ``same_loss`` checks the two reach the same test loss (rel 1e-4), as they must:
replication changes where rows run, not the maths. Modelled: the ideal ratio for stage costs
1 : 2 with the heavy one halved, ``max(1, 2/2) / max(1, 2) = 0.5`` on free cores; with 3
single-threaded workers on ``os.cpu_count()`` cores the ranks time-share (``cores`` is
reported), so on 2 cores the measured ratio is bounded by the machine, not the schedule.
Prints one JSON object. ``--quick``: 2 repeats of 20 steps; ``--smoke``: 1 repeat of 2
steps (every code path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import provenance  # noqa: E402

from paratrain.config.job import JobConfig, load_job  # noqa: E402
from paratrain.dispatch import execute  # noqa: E402

EXAMPLE = ROOT / "examples" / "pipeline_replicated_stage.toml"


def _job(tmp: Path, name: str, steps: int, replicated: bool) -> JobConfig:
    doc = load_job(EXAMPLE).to_json_dict()
    doc["run"].update(name=name, output_dir=str(tmp), imports=[str(EXAMPLE.parent / "residual_model.py")],
                      checkpoint_every=10_000)
    doc["train"].update(max_steps=steps, eval_every=steps)
    if not replicated:
        doc["subgraphs"] = {}
        doc["workers"] = doc["workers"][:2]
    return JobConfig.model_validate(doc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 repeats of 20 steps")
    ap.add_argument("--smoke", action="store_true", help="1 repeat of 2 steps: every code path")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 20, 2
    if args.smoke:
        args.steps, args.repeats = 2, 1
    runs: dict[str, list[dict[str, Any]]] = {"replicated": [], "unreplicated": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.repeats):
            for kind in ("unreplicated", "replicated"):
                out = execute(_job(Path(d), f"{kind}{r}", args.steps, kind == "replicated"))
                runs[kind].append(out)
    med = {k: statistics.median(o["median_step_time_s_measured"] for o in v) for k, v in runs.items()}
    loss = {k: v[0]["test_loss"] for k, v in runs.items()}
    result: dict[str, Any] = {
        "benchmark": "replicated_stage",
        "config": {"cores": os.cpu_count(), "steps": args.steps, "repeats": args.repeats,
                   "workers": {"replicated": 3, "unreplicated": 2}},
        "median_step_s_measured": {k: round(v, 5) for k, v in med.items()},
        "step_ratio_measured": round(med["replicated"] / med["unreplicated"], 4),
        "step_ratio_ideal_modelled": 0.5,
        "test_loss_measured": loss,
        "same_loss": abs(loss["replicated"] - loss["unreplicated"]) <= 1e-4 * abs(loss["unreplicated"]),
    }
    result["provenance"] = provenance(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
