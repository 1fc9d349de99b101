"""Client-level differential privacy (``[federated.dp]``, DP-FedAvg): test accuracy (digits)
and test loss (Shakespeare) against epsilon, for several noise multipliers.

Workloads, every run through the real round loop in one process with one intra-op thread
(``executors.federated.run_in_process``, ``run.num_threads = 1``: the same sums on any
machine), central mode, uniform client weights
(``weight_cap = 1``: the noised sum divided by the expected number of clients), delta 1e-5:

* ``digits``: 1,347 training rows over K = 100 IID clients (~13 rows each), a random 30 %
  per round (q = 0.3), MLP 64-32-10, E = 2 local epochs of SGD (lr 0.1, B = 10), FedAvgM on
  the server (momentum 0.9: McMahan et al. 2018 use server momentum too), clip S = 1.0,
  40 rounds.
* ``shakespeare``: examples/federated_shakespeare.toml's federation (1,297 speaking roles,
  a random 2 % = 26 per round, the 2-layer character GPT, AdamW clients, FedAvg), shortened
  to ``--shakespeare-rounds`` (4) rounds of 1 local epoch, clip S = 2.0 (about the 60th
  percentile of the update norms in round 2).

Levels: no DP at all, clipping without noise (z = 0: epsilon infinite), each noise
multiplier of ``--levels`` and (digits) of ``--adaptive-levels`` with adaptive clipping
(target quantile 0.5, Andrew et al. 2021; the count's noise std is the default, 30 / 20, and
the updates' multiplier is raised so that the round's total stays z) and of
``--local-levels`` in local mode (each client noises its own update; accounted at q = 1). Per run: epsilon (modelled: Opacus's RDP bound for the rounds
run, the figure the summary reports), the final and best test accuracy / loss (measured)
and the wall time (measured, on a shared 2-core machine). One JSON object.
``--quick``: digits only, 10 rounds, levels 1.0 and 2.0, adaptive 1.0. ``--smoke``: both
tasks, 1 round, one level of each kind (Shakespeare: only its noise level), 10 digits
clients (2 a round, 1 local epoch), 2 Shakespeare clients a round, one test play and a
1-layer GPT 16 wide (every code path).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


SMOKE = False  # --smoke: 10 digits clients (2 a round, 1 local epoch), 2 Shakespeare clients a round, a tiny GPT


def _digits(out: str, name: str, rounds: int, dp: dict[str, Any] | None) -> Any:
    from paratrain.config.job import load_job

    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 0, "output_dir": out, "num_workers": 1, "num_threads": 1},
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits", "partition": {"method": "iid"}},
        "train": {"optimizer": {"name": "sgd", "lr": 0.1}},
        "strategy": {"type": "Federated", "num_clients": 100, "rounds": rounds,
                     "aggregation": {"method": "FedAvgM", "server_momentum": 0.9, "server_lr": 1.0},
                     "client_selection": {"method": "Random", "fraction": 0.3}},
        "federated": {"local_epochs": 2, "batch_size": 10, **({"dp": dp} if dp else {})},
    }
    if SMOKE:
        doc["strategy"].update(num_clients=10, client_selection={"method": "Random", "fraction": 0.2})
        doc["federated"]["local_epochs"] = 1
    return load_job(doc)


def _shakespeare(out: str, name: str, rounds: int, dp: dict[str, Any] | None) -> Any:
    import tomllib

    from paratrain.config.job import load_job

    doc = tomllib.loads((ROOT / "examples" / "federated_shakespeare.toml").read_text())
    doc["run"].update(name=name, output_dir=out, num_workers=1, num_threads=1)
    doc["strategy"]["rounds"] = rounds
    doc["federated"]["local_epochs"] = 1
    if dp:
        doc["federated"]["dp"] = dp
    if SMOKE:
        doc["strategy"]["client_selection"]["fraction"] = 2 / doc["strategy"]["num_clients"]
        doc["model"].update(n_layer=1, n_embd=16, n_head=2)
        doc["data"]["test_every"] = 38  # one test play of the 38
    return load_job(doc)


def _levels(clip: float, levels: list[float], adaptive: Sequence[float] = (), local: Sequence[float] = ()) -> list[tuple[str, dict[str, Any] | None]]:
    out: list[tuple[str, dict[str, Any] | None]] = [("no_dp", None), ("clip_only", {"clip": clip, "noise_multiplier": 0.0})]
    out += [(f"z{z:g}", {"clip": clip, "noise_multiplier": z}) for z in levels]
    # adaptive clipping (Andrew et al.): the clip follows the median update norm from `clip`
    out += [(f"z{z:g}_adaptive", {"clip": clip, "noise_multiplier": z, "target_quantile": 0.5}) for z in adaptive]
    # local DP: each client noises its own update (accounted at q = 1)
    out += [(f"z{z:g}_local", {"clip": clip, "noise_multiplier": z, "mode": "local"}) for z in local]
    return out


def _run(build: Any, out: str, name: str, rounds: int, dp: dict[str, Any] | None, metric: str) -> dict[str, Any]:
    from paratrain.executors.federated import run_in_process

    t = time.perf_counter()
    s = run_in_process(build(out, name, rounds, dp))
    row: dict[str, Any] = {
        "noise_multiplier": None if dp is None else dp["noise_multiplier"],
        "clip": None if dp is None else dp["clip"],
        "epsilon": s.get("epsilon"),  # None: no noise, no finite guarantee
        "delta": s.get("delta"),
        "rounds": s["rounds"],
        f"final_test_{metric}": s[f"test_{metric}"],
        f"best_test_{metric}": s[f"best_test_{metric}"],
        "wall_s": round(time.perf_counter() - t, 1),
    }
    if "bigram_test_loss" in s:
        row["bigram_test_loss"] = s["bigram_test_loss"]
    print(json.dumps({name: row}), file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["digits", "shakespeare", "both"], default="both")
    ap.add_argument("--levels", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--adaptive-levels", type=float, nargs="*", default=[1.0, 2.0],
                    help="digits: noise multipliers also run with adaptive clipping (target quantile 0.5)")
    ap.add_argument("--local-levels", type=float, nargs="*", default=[1.0],
                    help="digits: noise multipliers also run in local mode")
    ap.add_argument("--shakespeare-levels", type=float, nargs="+", default=[0.03, 0.1, 0.3])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--shakespeare-rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="both tasks, 1 round, one level of each kind, "
                    "smaller federations: every code path")
    args = ap.parse_args()
    if args.quick:
        args.task, args.rounds, args.levels, args.adaptive_levels, args.local_levels = "digits", 10, [1.0, 2.0], [1.0], []
    if args.smoke:
        global SMOKE
        SMOKE = True
        args.task, args.rounds, args.shakespeare_rounds = "both", 1, 1
        # adaptive: the count's noise (2 clients / 20) must exceed z / 2
        args.levels, args.adaptive_levels, args.local_levels, args.shakespeare_levels = [1.0], [0.1], [1.0], [0.1]
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out:
        if args.task in ("digits", "both"):
            results["digits"] = {name: _run(_digits, out, f"digits_{name}", args.rounds, dp, "accuracy")
                                 for name, dp in _levels(1.0, args.levels, args.adaptive_levels, args.local_levels)}
        if args.task in ("shakespeare", "both"):
            levels = _levels(2.0, args.shakespeare_levels)
            if SMOKE:  # the baselines' code paths are the digits runs'
                levels = levels[2:]
            results["shakespeare"] = {name: _run(_shakespeare, out, f"shak_{name}", args.shakespeare_rounds, dp, "loss")
                                      for name, dp in levels}
    doc: dict[str, Any] = {
        "benchmark": "federated_dp",
        "config": {"digits": {"num_clients": 100, "fraction": 0.3, "rounds": args.rounds, "clip": 1.0,
                              "aggregation": "FedAvgM(0.9)", "local_epochs": 2},
                   "shakespeare": {"num_clients": 1297, "fraction": 0.02, "rounds": args.shakespeare_rounds,
                                   "clip": 2.0, "aggregation": "FedAvg", "local_epochs": 1},
                   "mode": "central", "weight_cap": 1, "delta": 1e-5},
        "results": results,
    }
    doc["provenance"] = provenance({"results": results}, modelled=("epsilon",),
                                   configured=("noise_multiplier", "clip", "delta", "rounds"))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
