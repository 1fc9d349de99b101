"""What both runtimes keep in the run folder: Federated's state in the run's one checkpoint
format, each round's record, the run's summary and model.

``checkpoints/step-<r>/`` (:class:`~paratrain.training.stores.RankStore`, kind ``fed``) holds
``model/<name>`` (the global model, process 0's), ``engine/rank0`` the server's other state
and ``engine/rank<r>`` the state of the clients process ``r`` hosts, keyed ``client-<c>``; on
another number of workers every process keeps the clients it hosts now. Flower's ServerApp
writes the same format, the server's state alone (its clients' lives on the nodes), and so
does process 0 of a local run whose clients keep no state: with nothing on the other
processes, DCP's planning collectives and the barriers cost each round's save more CPU than
its write (2 workers, 100 clients: 9 ms of a 50 ms round on process 0, 5 ms on process 1),
so process 0 saves alone, without a collective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...comm import collectives as C
from ...comm.groups import alone_group
from ...config import ConfigError
from ...training.lifecycle import engine_state
from ...training.stores import RankStore


def fed_store(run_dir: str | Path, *, rank: int, world: int, group: Any, runtime: str) -> RankStore:
    """The run's checkpoint store (kind ``fed``)."""
    return RankStore(run_dir, "fed", rank=rank, world=world, group=group,
                     layout={"strategy": "Federated", "runtime": runtime},
                     layout_field="run.num_workers", reshard="engines")


def round_state(server: Any, host: Any, done: int) -> dict[str, Any]:
    """This process's state after ``done`` rounds: the server's (process 0) and the hosted
    clients' (``host``; None: stateless clients)."""
    engine: dict[str, Any] = {}
    model: dict[str, Any] = {}
    if host is not None:
        engine["clients"] = host.state_dict()
    if server is not None:
        srv = server.state_dict()
        model = srv.pop("model")
        engine["server"] = srv
    return engine_state(done, engine, model)


class _Stateless:
    """The store of a process whose clients keep no state: nothing to save or load."""

    def load(self) -> None:
        return None

    def save(self, step: int, state: dict[str, Any]) -> None:
        pass

    start_save = save

    def wait(self) -> None:
        pass


def local_store(run_dir: str | Path, *, rank: int, world: int, group: Any, stateful: bool) -> Any:
    """The local runtime's store: every process's (collective) when clients keep state, else
    process 0's alone (module docstring)."""
    if stateful:
        return fed_store(run_dir, rank=rank, world=world, group=group, runtime="local")
    if rank > 0:
        return _Stateless()
    return fed_store(run_dir, rank=0, world=1, group=alone_group() if world > 1 else group, runtime="local")


def restore(life: Any, server: Any, host: Any, *, resume: bool, rank: int = 0, world: int = 1,
            group: Any = None, solo: bool = False) -> tuple[int, bool]:
    """On ``resume``, load the newest checkpoint (``life.load``) into the server and the hosted
    clients (``solo``: process 0 alone holds one); returns ``(rounds done, whether one was
    found)``, the same on every process. A checkpoint that cannot be read or is another job's
    is a ConfigError on every process, named by process 0."""
    problem: list[Any] = []
    found: tuple[Any, dict[str, Any]] | None = None
    try:
        found = life.load() if resume else None
    except ConfigError as e:  # solo: process 0's alone; else every process raised it
        if not solo or world == 1:
            raise
        problem = [list(p) for p in e.problems]
    done = 0
    if found is not None:
        source, state = found
        engines = state["engines"] if state.get("resharded") else [state["engine"]]
        done = int(state["step"])
        if server is not None:
            srv = dict(engines[0].get("server") or {})
            try:
                if not srv:
                    raise ConfigError([("checkpoint", f"{source} holds no Federated server state")])
                srv["model"] = state["model"]
                server.check_state(srv, source=source)
                server.load_state_dict(srv)
            except ConfigError as e:
                problem = [list(p) for p in e.problems]
    was = found is not None
    if world > 1 and (solo or was):  # not solo: every process found it or none did
        problem, done, was = json.loads(C.broadcast_bytes(json.dumps([problem, done, was]).encode()
                                                          if rank == 0 else None, group=group).decode())
    if problem:
        raise ConfigError([tuple(p) for p in problem])
    if host is not None and found is not None:  # every old process's clients (resharded), those hosted here
        clients: dict[str, dict[str, Any]] = {}
        for eng in engines:
            for part, entries in dict(eng.get("clients") or {}).items():
                clients.setdefault(part, {}).update(
                    {n: s for n, s in dict(entries).items() if host.hosts(int(str(n).removeprefix("client-")))})
        host.load_state_dict(clients)
    return done, was


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
