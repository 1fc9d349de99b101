"""Federated benchmark: client updates per second and peak memory, 100 and 1,000 clients.

Workload: digits, MLP 64-64-10, IID split, every client selected every round
(``All``), 1 local epoch, B = 10, FedAvg, 2 worker processes (gloo, 127.0.0.1).

* ``paratrain``: the real round loop (``executors.federated.worker_main`` on 2 ranks:
  broadcast, local training, updates over point-to-point, aggregation, evaluation,
  checkpoint). Throughput = client updates / round wall time (median over rounds).
* ``naive`` peer, measured in the same run on the same 2 processes: the textbook
  PyTorch simulation that keeps one ``nn.Module`` + optimizer alive per client, trains
  them in turn and averages with an all-reduce (no checkpoints, no evaluation).
* ``flwr``: Flower's simulation of the same workload, only if ``flwr`` is importable
  (optional ``bench`` extra; not installed here -> reported as skipped).

Peak memory = the largest ``ru_maxrss`` of the two processes (each run in fresh
processes). Prints one JSON object with the ratios paratrain/peer. ``--quick`` runs
fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _job(out: str, k: int, rounds: int) -> dict[str, Any]:
    from _workers_federated import fed_job

    return fed_job(out, f"bench{k}", K=k, rounds=rounds, local_epochs=1, batch_size=10,
                   sel={"method": "All"}, num_workers=2).to_json_dict()


def paratrain_rank(ctx: Any, job_doc: dict[str, Any]) -> dict[str, Any] | None:
    from paratrain.config.job import load_job
    from paratrain.executors.federated import worker_main

    torch.set_num_threads(1)
    return worker_main(ctx, load_job(job_doc), False)


def naive_rank(ctx: Any, k: int, rounds: int) -> dict[str, Any]:
    """One live model + optimizer per hosted client; FedAvg through all_reduce."""
    import torch.distributed as dist
    from torch import nn

    from paratrain.config.job import DataSpec, ModelSpec
    from paratrain.data import load_data
    from paratrain.data.partition import partition_iid
    from paratrain.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = load_data(DataSpec(), seed=0).train.tensors
    parts = partition_iid(len(y), k, seed=0)
    spec = ModelSpec.model_validate({"name": "mlp", "hidden": [64]})
    glob = build_model(spec, input_shape=(64,), num_classes=10)
    mine = [c for c in range(k) if c % ctx.world_size == ctx.rank]
    models = {c: build_model(spec, input_shape=(64,), num_classes=10) for c in mine}
    opts = {c: torch.optim.SGD(models[c].parameters(), lr=0.1) for c in mine}
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for p in glob.parameters():
            dist.broadcast(p.data, src=0)
        acc = [torch.zeros_like(p) for p in glob.parameters()]
        total = torch.zeros(1)
        for c in mine:
            m = models[c]
            m.load_state_dict(glob.state_dict())
            idx = torch.from_numpy(parts[c])
            perm = idx[torch.randperm(len(idx))]
            for i in range(0, len(perm), 10):
                b = perm[i : i + 10]
                opts[c].zero_grad()
                nn.functional.cross_entropy(m(x[b]), y[b]).backward()
                opts[c].step()
            for a, p in zip(acc, m.parameters(), strict=True):
                a.add_(p.detach(), alpha=float(len(idx)))
            total += len(idx)
        for a in acc:
            dist.all_reduce(a)
        dist.all_reduce(total)
        with torch.no_grad():
            for p, a in zip(glob.parameters(), acc, strict=True):
                p.copy_(a / total)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"round_times": times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 2 if args.quick else 4
    from paratrain.comm.testing import run_distributed
    from paratrain.training import read_metrics

    out: dict[str, Any] = {
        "workload": "digits MLP 64-64-10, IID, All clients, E=1, B=10, FedAvg, 2 worker processes",
        "rounds": rounds,
        "peer": "naive per-client-model PyTorch loop on the same 2 processes (all client models alive)",
        "results": {},
    }
    try:
        import flwr  # noqa: F401

        out["flwr"] = "importable but not wired in this version"
    except ImportError:
        out["flwr"] = "skipped: flwr not importable (optional bench extra)"
    for k in (100, 1000):
        with tempfile.TemporaryDirectory() as tmp:
            summary = run_distributed(paratrain_rank, 2, _job(tmp, k, rounds), timeout_s=900)[0]
            recs = [r for r in read_metrics(summary["run_dir"]) if "round" in r]
            ups = [r["clients_ok"] / r["round_time_s"] for r in recs]
            ours = {
                "client_updates_per_s": round(statistics.median(ups), 1),
                "peak_rss_mb": max(w["peak_rss_mb"] for w in summary["workers"]),
            }
        naive = run_distributed(naive_rank, 2, k, rounds, timeout_s=900)
        n_ups = [k / t for t in naive[0]["round_times"]]
        peer = {
            "client_updates_per_s": round(statistics.median(n_ups), 1),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in naive), 1),
        }
        out["results"][str(k)] = {
            "paratrain": ours,
            "naive": peer,
            "throughput_ratio": round(ours["client_updates_per_s"] / peer["client_updates_per_s"], 3),
            "peak_memory_ratio": round(ours["peak_rss_mb"] / peer["peak_rss_mb"], 3),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
