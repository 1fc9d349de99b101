"""Drift correction benchmark: rounds to a target test accuracy for FedAvg, FedProx,
SCAFFOLD and FedNova on a label-skewed and an IID split of digits.

Workload (as in Karimireddy et al. 2020 and Flower's niid_bench, scaled to 2 cores): digits
(1,347 training rows), an MLP 64-32-10, ``K = 10`` clients, a random half of them each round,
``E = 5`` local epochs of SGD (lr 0.1, B = 20), the server evaluating the global model on
the test split after every round; targets 0.80 (shards) and 0.93 (iid) test accuracy, at most
30 rounds. Splits: ``shards`` (label-sorted shards, 2 per client: most
clients see two labels; McMahan et al.'s pathological non-IID split) and ``iid``. Methods:
FedAvg, FedProx (mu = 0.01), SCAFFOLD (option II, eta_g = 1) and FedNova (plain SGD: a_i =
tau_i). Every run goes through the real round loop in one process with one intra-op thread
(``executors.federated.run_in_process``, ``run.num_threads = 1``: the same sums on any machine), stopping at the target (``federated.target_accuracy``)
or at the round cap; a run that never reaches the target counts as the cap + 1 (reported
``reached``). ``--splits dirichlet`` (alpha 0.3, unequal client sizes, so unequal local step
counts: FedNova's case; on shards and iid every client holds 134-135 rows, takes the same
7 x E steps and FedNova is FedAvg) is not in the default run. Per split and method: the rounds to target of each seed and their median
(measured: counted rounds), and the final/best test accuracy medians (measured).

Prints one JSON object. ``--quick``: 1 seed, shards split only. ``--smoke``: that with 1
local epoch and at most 2 rounds (every code path, seconds).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance  # noqa: E402

METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"method": "FedAvg"},
    "FedProx": {"method": "FedProx", "mu": 0.01},
    "SCAFFOLD": {"method": "SCAFFOLD", "server_lr": 1.0},
    "FedNova": {"method": "FedNova"},
}
SPLITS: dict[str, dict[str, Any]] = {
    "shards": {"method": "shards", "shards_per_client": 2},
    "iid": {"method": "iid"},
    # not in the default run: unequal client sizes, hence unequal local step counts (FedNova's case)
    "dirichlet": {"method": "dirichlet", "alpha": 0.3, "min_size": 20},
}
K, FRACTION, EPOCHS, BATCH, LR, HIDDEN = 10, 0.5, 5, 20, 0.1, 32
TARGET = {"shards": 0.80, "iid": 0.93, "dirichlet": 0.85}
CAP = 30


SMOKE = False  # --smoke: 1 local epoch, a cap of 2 rounds


def job_doc(out: str, method: str, split: str, seed: int) -> dict[str, Any]:
    from paratrain.config.job import load_job

    doc: dict[str, Any] = {
        "run": {"name": f"{split}-{method}-{seed}", "seed": seed, "output_dir": out, "num_threads": 1,
                "checkpoint_every": CAP, "progress_every": 0},
        "model": {"name": "mlp", "hidden": [HIDDEN]},
        "train": {"optimizer": {"name": "sgd", "lr": LR}},
        "data": {"partition": SPLITS[split]},
        "strategy": {"type": "Federated", "num_clients": K, "rounds": CAP,
                     "aggregation": METHODS[method],
                     "client_selection": {"method": "Random", "fraction": FRACTION}},
        "federated": {"local_epochs": EPOCHS, "batch_size": BATCH, "target_accuracy": TARGET[split]},
    }
    if SMOKE:
        doc["run"]["checkpoint_every"] = doc["strategy"]["rounds"] = 2
        doc["federated"]["local_epochs"] = 1
    return load_job(doc).to_json_dict()


def one(out: str, method: str, split: str, seed: int) -> dict[str, Any]:
    from paratrain.config.job import load_job
    from paratrain.executors.federated import run_in_process

    t = time.perf_counter()
    s = run_in_process(load_job(job_doc(out, method, split, seed)))
    rtt = s["rounds_to_target"]
    cap = 2 if SMOKE else CAP
    return {"rounds_to_target": cap + 1 if rtt is None else int(rtt), "reached": rtt is not None,
            "rounds_run": int(s["rounds"]), "final_test_accuracy": float(s["test_accuracy"]),
            "best_test_accuracy": float(s["best_test_accuracy"]), "wall_s": round(time.perf_counter() - t, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, shards split only")
    ap.add_argument("--smoke", action="store_true", help="--quick with 1 local epoch and 2 rounds at most")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--splits", default="shards,iid", help="comma-separated: shards, iid, dirichlet")
    args = ap.parse_args()
    if args.smoke:
        global SMOKE
        SMOKE = args.quick = True
    seeds = [0] if args.quick else list(range(args.seeds))
    splits = ["shards"] if args.quick else args.splits.split(",")
    torch.set_num_threads(1)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out:
        for split in splits:
            results[split] = {}
            for method in METHODS:
                runs = [one(out, method, split, s) for s in seeds]
                results[split][method] = {
                    "rounds_to_target_per_seed": [r["rounds_to_target"] for r in runs],
                    "reached_per_seed": [r["reached"] for r in runs],
                    "test_accuracy_at_stop_per_seed": [round(r["final_test_accuracy"], 4) for r in runs],
                    "median_rounds_to_target": statistics.median(r["rounds_to_target"] for r in runs),
                    "median_final_test_accuracy": round(statistics.median(r["final_test_accuracy"] for r in runs), 4),
                    "median_best_test_accuracy": round(statistics.median(r["best_test_accuracy"] for r in runs), 4),
                    "wall_s": round(sum(r["wall_s"] for r in runs), 1),
                }
    summary = {
        f"{m.lower()}_over_fedavg_rounds_{split}": round(
            r[m]["median_rounds_to_target"] / r["FedAvg"]["median_rounds_to_target"], 3)
        for split, r in results.items() for m in METHODS if m != "FedAvg"}
    doc = {
        "config": {"clients": K, "fraction": FRACTION, "local_epochs": 1 if SMOKE else EPOCHS, "batch_size": BATCH,
                   "lr": LR, "hidden": HIDDEN, "target_accuracy": TARGET, "round_cap": 2 if SMOKE else CAP,
                   "seeds": seeds, "fedprox_mu": METHODS["FedProx"]["mu"]},
        "results": results,
        "summary": summary,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "load_average_start": os.getloadavg()[0],
    }
    doc["provenance"] = provenance(doc)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
