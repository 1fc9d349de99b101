"""FedBuff benchmark: wall time to a target test accuracy with one client 10x slower than the
others, asynchronous buffered aggregation (FedBuff, Nguyen et al. 2022) against synchronous
FedAvg on the same clients and processes.

Workload: digits (1,347 training rows), an MLP 64-32-10, ``K = 10`` clients on a label-skewed
split (``shards``, 2 label-sorted shards per client), ``E = 2`` local epochs of SGD (lr 0.1,
B = 20), 3 worker processes (``paratrain run``'s launcher); client 1 made 10x slower
(``PARATRAIN_FAULT_SLOW_CLIENT=1:10``: it trains its update 10 times over, the same update,
10x the work). FedAvg: every client every round, rank ``c % 3`` training client ``c`` (a
round waits for the slow one). FedBuff: ``concurrency = 10``, ``buffer_size = 5``, staleness
weight ``1/sqrt(1+s)``; ranks 1 and 2 each train one client at a time, taking the next
queued client when they reply (the slow client holds one rank), rank 0 (the server) one when
no update is at hand.
Both stop at the target (``federated.target_accuracy``) or a cap (FedAvg 40 rounds, FedBuff
80 versions: the same client updates). Time to target (measured): the ``time_s`` stamp of the
first evaluation at or above the target, from the start of the worker processes' loop setup
(the same origin for both), less the evaluation time of every round/version up to it
(``eval_s``): FedBuff evaluates per version (5 updates), twice as often as FedAvg's rounds
(10), so evaluation is excluded from both (with it: ``time_to_target_with_eval_s``). While
FedBuff's server evaluates, ranks 1 and 2 finish the client they hold (then wait), so the
exclusion credits FedBuff at most that overlap. Beside it the rounds/versions and the client
updates applied.
``fedbuff_speedup_to_target`` = FedAvg's time / FedBuff's (> 1 favours FedBuff). The same
jobs without the slow client are reported beside (``no_straggler``).

Prints one JSON object. ``--quick``: 1 seed. ``--smoke``: 2 rounds/versions, 1 local epoch,
no target (every code path, seconds).
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

K, WORKERS, EPOCHS, BATCH, LR, HIDDEN, TARGET, SLOW = 10, 3, 5, 10, 0.05, 256, 0.85, "1:10"
ARMS: dict[str, tuple[dict[str, Any], int]] = {
    "FedAvg": ({"method": "FedAvg"}, 40),
    "FedBuff": ({"method": "FedBuff", "concurrency": 10, "buffer_size": 5}, 80),
}
SMOKE = False


def job_doc(out: str, arm: str, seed: int) -> dict[str, Any]:
    agg, cap = ARMS[arm]
    doc: dict[str, Any] = {
        "run": {"name": f"{arm}-{seed}", "seed": seed, "output_dir": out, "num_workers": WORKERS,
                "checkpoint_every": cap, "progress_every": 0},
        "model": {"name": "mlp", "hidden": [HIDDEN]},
        "train": {"optimizer": {"name": "sgd", "lr": LR}},
        "data": {"partition": {"method": "shards", "shards_per_client": 2}},
        "strategy": {"type": "Federated", "num_clients": K, "rounds": 2 if SMOKE else cap, "aggregation": agg,
                     "client_selection": {"method": "All"}},
        "federated": {"local_epochs": 1 if SMOKE else EPOCHS, "batch_size": BATCH},
    }
    if not SMOKE:
        doc["federated"]["target_accuracy"] = TARGET
    return doc


def one(out: str, arm: str, seed: int, slow: bool) -> dict[str, Any]:
    from paratrain.config.job import load_job
    from paratrain.dispatch import execute
    from paratrain.executors.federated.client import SLOW_ENV
    from paratrain.training import read_metrics

    if slow:
        os.environ[SLOW_ENV] = SLOW
    try:
        s = execute(load_job(job_doc(out, arm, seed)), overwrite=True)
    finally:
        os.environ.pop(SLOW_ENV, None)
    recs = read_metrics(Path(s["run_dir"]))
    hit = next((r for r in recs if float(r.get("test_accuracy", 0.0)) >= TARGET), None)
    evals = sum(float(r["eval_s"]) for r in recs if hit is not None and r["round"] <= hit["round"])
    return {"reached": hit is not None,
            "time_to_target_s": None if hit is None else round(float(hit["time_s"]) - evals, 3),
            "time_to_target_with_eval_s": None if hit is None else round(float(hit["time_s"]), 3),
            "rounds_to_target": None if hit is None else int(hit["round"]),
            "client_updates_applied": sum(int(r["clients_ok"]) for r in recs if hit is None or r["round"] <= hit["round"]),
            "final_test_accuracy": float(s["test_accuracy"]),
            "max_staleness": max((int(r.get("staleness_max", 0)) for r in recs), default=0),
            "wall_s": round(float(s["wall_time_s"]), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed")
    ap.add_argument("--smoke", action="store_true", help="2 rounds, 1 local epoch, no target")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    if args.smoke:
        global SMOKE
        SMOKE = args.quick = True
    seeds = [0] if args.quick else list(range(args.seeds))
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out:
        for case, slow in (("straggler", True), ("no_straggler", False)):
            results[case] = {}
            for arm in ARMS:
                runs = [one(out, arm, s, slow) for s in seeds]
                times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
                results[case][arm] = {"runs": runs,
                                      "median_time_to_target_s": statistics.median(times) if len(times) == len(runs)
                                      else None}
    summary = {}
    for case, r in results.items():
        a, b = r["FedAvg"]["median_time_to_target_s"], r["FedBuff"]["median_time_to_target_s"]
        summary[f"fedbuff_speedup_to_target_{case}"] = round(a / b, 3) if a and b else None
    doc = {
        "config": {"clients": K, "workers": WORKERS, "local_epochs": 1 if SMOKE else EPOCHS, "batch_size": BATCH,
                   "lr": LR, "hidden": HIDDEN, "target_accuracy": TARGET, "slow_client": SLOW, "seeds": seeds,
                   "arms": {k: {"aggregation": v[0], "cap": v[1]} for k, v in ARMS.items()}},
        "results": results, "summary": summary, "load_average_start": load_start,
        "wall_time_s": round(time.perf_counter() - started, 1)}
    print(json.dumps({**doc, "provenance": provenance(doc)}, indent=1))


if __name__ == "__main__":
    main()
