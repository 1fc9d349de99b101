"""Federated on Flower's Deployment Runtime against the local path: rounds per second and
bytes per round, the job of ``benchmarks/federated.py``.

Workload (``benchmarks/federated.py``'s): digits, MLP 64-64-10, IID split, ``--clients``
clients (default 100) all selected every round, 1 local epoch, B = 10, SGD lr 0.1, FedAvg,
checkpoint every round (the default), ``--rounds`` rounds (default 4: 1 warm-up + 3 timed).
``--smoke``: 4 clients, 2 rounds, 1 SuperNode (Flower's processes still take tens of seconds to
start; each ClientApp process imports torch).

* ``local``: ``paratrain run`` of the job (``runtime = "local"``), 2 worker processes over
  gloo (the default).
* ``flower``: the same job (``runtime = "flower"``) with ``flwr run`` against a real
  ``flower-superlink --insecure`` and ``--nodes`` ``flower-supernode`` processes on 127.0.0.1
  (default 2, ``--smoke`` 1: partition p of 2 hosts clients c % 2 == p, as the 2 local workers do;
  ``--nodes K`` = one SuperNode per client). Flower runs every message in a new
  ``flwr-clientapp`` process that imports torch and builds the job's data, which dominates
  a round of this small model.

Rounds per second (measured): 1 / the median period between consecutive rounds' ``time_s``
stamps in metrics.jsonl, round 1 left out (both runtimes stamp a round after its
evaluation; a period holds the previous round's checkpoint and this round's selection,
training, upload, aggregation and evaluation), as ``benchmarks/federated.py`` times
paratrain; ``round_time_s`` (selection to logged round, no checkpoint) is reported too.

``--secure``: instead, plaintext against SecAgg+ (``[federated.flower.secure_aggregation]``,
Flower's SecAggPlusWorkflow / secaggplus_mod) on the same federation of ``--nodes`` SuperNodes
with one client each (``num_clients = --nodes``), ``--rounds`` rounds each; ``--drop K``
adds a SecAgg+ run in which K nodes exit after masking (on the unmask stage). Each secure
model's max |difference| from the plaintext one is reported with the fixed-point bound
(one quantization step per node).

Per round (measured, metrics.jsonl): the round period and ``round_time_s`` (medians over
rounds after the first), the round's measured bytes down / up: for the local path the process-group traffic (model
broadcast to the other worker, update payloads received), for Flower the Message bytes
(every serialized object of the messages pushed and the replies pulled). Prints one JSON.
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

from paratrain.config.job import load_job
from paratrain.dispatch import execute

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the local federation harness
from _common import provenance  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "examples" / "federated_flower"
# SuperExec task poll (s): the figures in RESULTS.md were measured at 0.3 (tests use Flower's
# default 1 s, which spends less CPU polling and adds about 0.35 s per message)
POLL_S = 0.3


def job(out: Path, name: str, runtime: str, rounds: int, clients: int = 10,
        secure: bool = False) -> dict[str, Any]:
    """``benchmarks/federated.py``'s job (B = 10, SGD lr 0.1) on ``runtime``."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 0, "output_dir": str(out), "num_workers": 2},
        "model": {"name": "mlp", "hidden": [64]},
        "data": {"name": "digits", "partition": {"method": "iid"}},
        "train": {"optimizer": {"name": "sgd", "lr": 0.1}},
        "strategy": {"type": "Federated", "num_clients": clients, "rounds": rounds,
                     "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}},
        "federated": {"local_epochs": 1, "batch_size": 10, "runtime": runtime},
    }
    if runtime == "flower":
        doc["federated"]["flower"] = {"round_timeout": 600.0, "min_nodes": 1, "node_timeout": 120.0}
        if secure:
            doc["federated"]["flower"].update(min_nodes=clients, secure_aggregation={"num_shares": 1.0})
    return doc


def per_round(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    later = rows[1:] or rows
    stamps = [float(r["time_s"]) for r in rows]
    periods = [b - a for a, b in zip(stamps, stamps[1:], strict=False)] or [stamps[-1]]
    period = statistics.median(periods)
    return {
        "rounds_per_s_measured": round(1.0 / period, 4),
        "round_period_s_median": round(period, 4),
        "round_periods_s": [round(p, 4) for p in periods],
        "round_time_s_median": round(statistics.median(r["round_time_s"] for r in later), 4),
        "round_time_s": [round(r["round_time_s"], 4) for r in rows],
        "bytes_down_per_round_measured": rows[-1]["wire_bytes_down_measured"],
        "bytes_up_per_round_measured": rows[-1]["wire_bytes_up_measured"],
        "update_bytes_per_round_measured": rows[-1]["bytes_up_measured"],
        "test_accuracy": rows[-1]["test_accuracy"],
    }


def flower_run(fed: Any, out: Path, path: Path, name: str) -> float:
    t1 = time.perf_counter()
    fed.run(APP, {"job": str(path)})
    summary = out / name / "summary.json"
    while not summary.exists():
        if time.perf_counter() - t1 > 1800:
            raise TimeoutError(fed.logs())
        time.sleep(0.2)
    return time.perf_counter() - t1


def secure(args: Any) -> None:
    from _flower_federation import LocalFederation

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        out = tmp / "runs"
        fed = LocalFederation(tmp / "flwr_home", args.nodes, task_poll_interval=POLL_S)
        res: dict[str, Any] = {"workload": f"digits MLP 64, {args.nodes} clients on {args.nodes} SuperNodes, FedAvg",
                               "config": {"rounds": args.rounds, "nodes": args.nodes, "drop": args.drop}}
        runs = [("plaintext", False), ("secagg", True)] + ([("secagg_drop", True)] if args.drop else [])
        try:
            fed.start()
            for name, sec in runs:
                if name == "secagg_drop":
                    # a federation of its own, whose last --drop nodes exit on the unmask stage's
                    # message (restarting nodes of the first one would leave their old ids
                    # listed as connected until the SuperLink's heartbeat timeout)
                    from paratrain.training.faults import DROP_AT_ENV

                    fed.close()
                    fed = LocalFederation(tmp / "flwr_home_drop", args.nodes, task_poll_interval=POLL_S)
                    fed.start(num_started=args.nodes - args.drop)
                    for i in range(args.nodes - args.drop, args.nodes):
                        fed.start_node(i, {DROP_AT_ENV: "unmask"})
                path = tmp / f"{name}.json"
                path.write_text(json.dumps(job(out, name, "flower", args.rounds, args.nodes, sec)))
                wall = flower_run(fed, out, path, name)
                res[name] = {"wall_s": round(wall, 2), **per_round(out / name)}
        finally:
            fed.close()
        for key in ("round_time_s_median", "bytes_down_per_round_measured", "bytes_up_per_round_measured"):
            res[f"{key}_secagg_over_plaintext"] = round(res["secagg"][key] / res["plaintext"][key], 2)
        # the unmasked sum against the plain one: fixed-point error, bounded by one
        # quantization step (2 * clipping_range / quantization_range) per node
        from safetensors.torch import load_file

        plain = load_file(str(out / "plaintext" / "model.safetensors"))
        for name, _ in runs[1:]:
            got = load_file(str(out / name / "model.safetensors"))
            res[f"max_abs_diff_{name}_vs_plaintext"] = max(float((got[k] - plain[k]).abs().max()) for k in plain)
        res["fixed_point_bound_modelled"] = args.nodes * 2 * 8.0 / 2**22
        res["provenance"] = provenance({k: v for k, v in res.items() if k != "config"},
                                       modelled=("fixed_point_bound_modelled",))
        print(json.dumps(res, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, help="rounds (default 4; --smoke 2)")
    ap.add_argument("--clients", type=int, help="clients (default 100; --smoke 4)")
    ap.add_argument("--smoke", action="store_true", help="4 clients, 2 rounds, 1 SuperNode: every arm, quickly")
    ap.add_argument("--quick", action="store_true", help="make bench's size: the default (100 clients, 4 rounds)")
    ap.add_argument("--nodes", type=int, help="SuperNodes (default 2; --smoke 1 without --secure)")
    ap.add_argument("--secure", action="store_true")
    ap.add_argument("--drop", type=int, default=0, help="--secure: also a run where this many nodes "
                    "drop out after masking (they exit on the unmask stage)")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.smoke else 4)
    args.clients = args.clients or (4 if args.smoke else 100)
    # one SuperNode at --smoke: a ClientApp process each round, not one per node (SecAgg+ needs 2)
    args.nodes = args.nodes or (1 if args.smoke and not args.secure else 2)
    if args.secure:
        secure(args)
        return
    from _flower_federation import LocalFederation

    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        out = tmp / "runs"
        t0 = time.perf_counter()
        local = execute(load_job(job(out, "local", "local", args.rounds, args.clients)))
        local_wall = time.perf_counter() - t0
        path = tmp / "flower.json"
        path.write_text(json.dumps(job(out, "flower", "flower", args.rounds, args.clients)))
        fed = LocalFederation(tmp / "flwr_home", args.nodes, task_poll_interval=POLL_S)
        try:
            fed.start()
            flower_wall = flower_run(fed, out, path, "flower")
            summary = out / "flower" / "summary.json"
        finally:
            fed.close()
        res: dict[str, Any] = {
            "workload": (f"digits MLP 64-64-10, {args.clients} clients IID, all selected, E=1, B=10, "
                         "SGD lr 0.1, FedAvg, checkpoint every round (benchmarks/federated.py's job)"),
            "config": {"rounds": args.rounds, "clients": args.clients, "local_workers": 2,
                       "supernodes": args.nodes},
            "loadavg_at_start_measured": [round(v, 2) for v in load_at_start],
            "local": {"wall_s": round(local_wall, 2), **per_round(Path(local["run_dir"]))},
            "flower": {"wall_s": round(flower_wall, 2), **per_round(out / "flower")},
            "same_parameters": json.loads(summary.read_text())["parameters_sha256"] == local["parameters_sha256"],
        }
        res["round_time_ratio_flower_over_local"] = round(
            res["flower"]["round_time_s_median"] / res["local"]["round_time_s_median"], 2)
        res["rounds_per_s_ratio_local_over_flower_measured"] = round(
            res["local"]["rounds_per_s_measured"] / res["flower"]["rounds_per_s_measured"], 2)
        res["provenance"] = provenance({k: v for k, v in res.items() if k != "config"})
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
