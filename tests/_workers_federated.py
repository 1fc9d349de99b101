"""Helpers for the federated tests: job builders and rank functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.comm.context import WorkerContext
from paratrain.config.job import JobConfig, load_job
from paratrain.executors.federated import worker_main

TOPK_EF = {"method": "ErrorFeedback", "error_compensation": True,
           "base_strategy": {"method": "TopK", "k": 200}}


def fed_job(out: Path | str, name: str, **kw: Any) -> JobConfig:
    """A small digits/MLP federated job; keyword arguments override sections."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": kw.pop("seed", 0), "output_dir": str(out),
                "num_workers": kw.pop("num_workers", 1), "max_restarts": kw.pop("max_restarts", 0)},
        "model": {"name": "mlp", "hidden": [kw.pop("hidden", 64)]},
        "train": {"optimizer": {"name": "sgd", "lr": kw.pop("lr", 0.1)}},
        "data": {"partition": kw.pop("partition", {"method": "iid"})},
        "strategy": {
            "type": "Federated", "num_clients": kw.pop("K", 10), "rounds": kw.pop("rounds", 3),
            "aggregation": kw.pop("agg", {"method": "FedAvg"}),
            "client_selection": kw.pop("sel", {"method": "All"}),
        },
    }
    if "compression" in kw:
        doc["compression"] = kw.pop("compression")
    if "workers" in kw:
        doc["workers"] = kw.pop("workers")
    doc["federated"] = kw
    return load_job(doc)


def rank_main(ctx: WorkerContext, job_doc: dict[str, Any], resume: bool) -> dict[str, Any] | None:
    """``worker_main`` on a ``run_distributed`` rank (job passed as JSON-able dict)."""
    return worker_main(ctx, load_job(job_doc), resume)


def rank_main_sequence(ctx: WorkerContext, job_docs: list[dict[str, Any]]) -> list[Any]:
    """Run several jobs one after another in the same ranks (rank 0's summaries)."""
    return [worker_main(ctx, load_job(doc), False) for doc in job_docs]
