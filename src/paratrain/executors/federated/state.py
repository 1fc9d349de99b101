"""Federated's state in the run's one checkpoint format.

``checkpoints/step-<r>/`` (:class:`~paratrain.training.stores.RankStore`, kind ``fed``) holds
``model/<name>`` (the global model, process 0's), ``engine/rank0`` the server's other state
and ``engine/rank<r>`` the state of the clients process ``r`` hosts, keyed ``client-<c>``; on
another number of workers every process keeps the clients it hosts now. Flower's ServerApp
writes the same format, the server's state alone (its clients' lives on the nodes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...comm import collectives as C
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


def restore(found: tuple[Any, dict[str, Any]] | None, server: Any, host: Any, *, rank: int,
            world: int, group: Any) -> int:
    """Load a resumed checkpoint (``found``, :meth:`RankStore.load`'s) into the server and the
    hosted clients; returns the rounds done. Another job's checkpoint is a ConfigError on
    every process, named by process 0."""
    if found is None:
        return 0
    source, state = found
    engines = state["engines"] if state.get("resharded") else [state["engine"]]
    problem: list[Any] = []
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
    if world > 1:
        problem = json.loads(C.broadcast_bytes(json.dumps(problem).encode() if rank == 0 else None,
                                               group=group).decode())
    if problem:
        raise ConfigError([tuple(p) for p in problem])
    if host is not None:  # every old process's clients (resharded), those hosted here kept
        clients: dict[str, dict[str, Any]] = {}
        for eng in engines:
            for part, entries in dict(eng.get("clients") or {}).items():
                clients.setdefault(part, {}).update(
                    {n: s for n, s in dict(entries).items() if host.hosts(int(str(n).removeprefix("client-")))})
        host.load_state_dict(clients)
    return int(state["step"])
