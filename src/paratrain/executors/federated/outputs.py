"""What both runtimes hand out: each round's record, the run's summary and model, each
client's whole model and the digest of every client's personal parts."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ...config import ConfigError


def save_client_models(run_dir: Path, model: Any, personal: Any, global_state: Any) -> None:
    """``model-client<c>.safetensors`` for every client this worker hosts: the global parts
    with the client's personal parts (``paratrain export RUN --client c``)."""
    import copy

    from ...models.state import load_unique_state_dict
    from ...training.export import client_model_file, save_model, whole_state

    scratch = copy.deepcopy(model).cpu()  # `model` stays the global one for the summary
    for c in personal.hosted:
        load_unique_state_dict(scratch, {**{k: v.cpu() for k, v in global_state.items()},
                                         **personal.of(c)})
        save_model(run_dir, whole_state(scratch), name=client_model_file(c))


def personal_digest(workers: list[dict[str, Any]]) -> str:
    """SHA-256 of every client's personal-part digest in client order (any worker layout)."""
    per = {c: d for w in workers for c, d in dict(w.get("personal_clients_sha256", {})).items()}
    order = sorted(per, key=lambda name: int(name.removeprefix("client-")))
    return hashlib.sha256("".join(per[c] for c in order).encode()).hexdigest()


def finish_run(side: Any, server: Any, run_dir: Path, *, final: dict[str, Any], final_per: dict[str, Any],
               wall_s: float, initial: dict[str, Any], head: dict[str, Any], extra: dict[str, Any],
               configured: tuple[str, ...], label: str) -> dict[str, Any]:
    """Both runtimes' end: the global model (personal keys at ``initial``, a new client's start)
    saved, ``summary.json`` and ``report.png`` written; returns the summary."""
    from ...models.state import load_unique_state_dict
    from ...training import parameters_digest, read_metrics, report, write_summary
    from ...training.export import save_model, whole_state

    job, task, model = side.job, side.task, side.model
    load_unique_state_dict(model, {**server.global_state, **initial})
    strat = job.strategy
    fit = str(task.fitness_metric)
    records = [rec for rec in read_metrics(run_dir) if rec.get(f"test_{fit}") is not None]
    pick = max if task.fitness_mode == "max" else min
    best = pick((float(rec[f"test_{fit}"]) for rec in records), default=final.get(fit))
    reference = getattr(task, "reference_metrics", None)
    summary = {
        **head,
        "strategy": "Federated",
        "run_dir": str(run_dir),
        "aggregation": strat.aggregation.method,
        "client_selection": strat.client_selection.method,
        "num_clients": strat.num_clients,
        "rounds": server.round,
        "rounds_to_target": server.rounds_to_target,
        "task": str(getattr(task, "name", type(task).__name__)),
        **{f"test_{k}": v for k, v in final.items()},
        f"best_test_{fit}": best,
        **(reference(side.train_set, side.test_set) if callable(reference) else {}),
        "clients_failed_total": server.failures,
        "bytes_up_measured": server.bytes_up,
        "bytes_down_modelled": server.bytes_down,
        "wire_bytes_down_measured": server.wire_bytes_down,
        "wire_bytes_up_measured": server.wire_bytes_up,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "wall_time_s": round(wall_s, 3),
        "parameters_sha256": parameters_digest(model),
        **final_per,
        **(server.privacy.summary() if server.privacy is not None else {}),  # [federated.dp]
        **extra,
    }
    summary["provenance"] = report.provenance(summary, configured=configured)
    save_model(run_dir, whole_state(model))
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, x_key="round", title=f"{job.run.name} ({label}, {strat.aggregation.method})")
    return summary


def round_record(server: Any, metrics: Any, rec: dict[str, Any], ev: dict[str, Any], per: dict[str, Any], *,
                 target: float | None, lr_scale: float, **extra: Any) -> dict[str, Any]:
    """Log round ``rec`` with the test metrics ``ev``, the clients' ``per`` and ``extra``; notes
    the accuracy for ``federated.target_accuracy`` (a ConfigError when the task has none)."""
    if target is not None and "accuracy" not in ev:
        raise ConfigError([("federated.target_accuracy", (
            f"the task's metrics ({', '.join(sorted(ev))}) have no accuracy"))])
    server.note_accuracy(ev.get("accuracy"), target)
    rec["lr_scale"] = lr_scale
    rec.update({f"test_{k}": v for k, v in ev.items()})
    rec.update(per)
    rec.update(extra)
    metrics.log(dict(rec))
    return rec
