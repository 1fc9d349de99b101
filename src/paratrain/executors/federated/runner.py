"""The round loop every worker process runs (rank 0 is also the server; DESIGN §4).

Per round rank 0 publishes the plan ``{"clients", "stop", "lr_scale"}`` in the store; the
global model (and SCAFFOLD's ``c``) is broadcast as flat tensors (:mod:`.wire`); every rank
trains its selected clients and sends their statuses (store) and payloads (point-to-point)
to rank 0, which aggregates, evaluates and logs. A round is the unit of the run's
:class:`~paratrain.training.lifecycle.Lifecycle`, and every random draw is a function of
(seed, round, client), so a resume ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...comm.collectives import (
    CommCounter,
    barrier,
    job_store,
    store_delete,
    store_get_json,
    store_set_json,
)
from ...comm.context import WorkerContext
from ...comm.messages import recv_bytes, send_bytes
from ...config import ConfigError
from ...config.job import JobConfig
from ...subgraphs import local_paths
from ...training import MetricsWriter, prepare_run_dir
from ...training.lifecycle import Lifecycle
from ...training.loop import peak_rss_mb
from ...training.rundir import run_dir_of
from .asynchronous import run_buffered
from .buffered import Buffered, is_buffered
from .checks import check_job, check_selection, client_tags
from .client import ClientHost
from .drift import broadcast_control, uses_control
from .flower.side import Side, build_side, stateful
from .personal import round_metrics, score_clients
from .privacy import build_server_privacy
from .selection import select_clients
from .server import FederatedServer, RoundSchedule
from .state import finish_run, local_store, restore, round_record, round_state
from .wire import broadcast_state, split_payload

_INVOCATIONS = 0


@dataclass
class _Worker:
    """What one rank holds through the run (:func:`_set_up`); rank 0 has the server."""

    ctx: WorkerContext
    job: JobConfig
    data: Side  # the task, the model, the data, the server's template
    host: ClientHost  # this rank's clients
    store: Any  # the control plane: the rendezvous store's keys of this job, or an in-memory one
    comm_dev: torch.device
    tags: Any
    run_dir: Path
    server: FederatedServer | None
    metrics: MetricsWriter | None
    life: Lifecycle
    traffic: CommCounter  # this rank's process-group bytes, booked by the transport
    started: float


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Run the federated job on this rank; rank 0 returns the summary."""
    started = time.perf_counter()
    w, start = _set_up(ctx, job, resume, started)
    strat: Any = job.strategy
    done = start
    with w.life:
        w.life.show(start)
        if is_buffered(job):  # FedBuff: versions as updates arrive (.asynchronous)
            done = run_buffered(w, start, _evaluate)
        for r in range(start, start if is_buffered(job) else strat.rounds):
            if not _round(w, r):
                break
            done = r + 1
            w.life.end_unit(done, last=done == strat.rounds)
    w.life.finish(done)  # stopped early (federated.target_accuracy): its checkpoint
    return _summary(w)


def _set_up(ctx: WorkerContext, job: JobConfig, resume: bool, started: float) -> tuple[_Worker, int]:
    """Check the job, build the data, the server (rank 0) and the lifecycle, restore; returns
    the worker and the first round to run."""
    strat: Any = job.strategy
    if getattr(strat, "type", None) != "Federated":
        raise ConfigError([("strategy.type", f"federated executor got {getattr(strat, 'type', None)!r}")])
    check_job(job, world_size=ctx.world_size)
    rank, world, group = ctx.rank, ctx.world_size, ctx.group
    # the same on every rank (each calls worker_main as often): a second job in the same
    # processes (and store) does not read the first one's control keys
    global _INVOCATIONS
    _INVOCATIONS += 1
    store = job_store(ctx.store, f"fed{_INVOCATIONS}")
    # NCCL moves only device tensors; gloo takes CPU tensors.
    comm_dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    data = build_side(job, partition=rank, num_partitions=world, device=ctx.device)
    host, template = data.host, data.template
    assert host is not None  # build_side with a partition builds it
    tags = client_tags(job, ctx)
    check_selection(job, tags)
    # on resume the run folder changes only after every process checked the checkpoint
    # (.state.restore); then rank 0 prepares it before anyone writes (the barrier below)
    run_dir = run_dir_of(job)
    server: FederatedServer | None = None
    metrics: MetricsWriter | None = None
    if rank == 0:
        schedule = RoundSchedule(job.train.lr_schedule, job.train.warmup_steps, strat.rounds)
        server = FederatedServer(strat.aggregation, template, schedule, num_clients=strat.num_clients)
        server.set_privacy(build_server_privacy(job, [len(p) for p in data.partitions], tags))  # [federated.dp]
        server.buffered = Buffered(job, tags) if is_buffered(job) else None
    kept = host if stateful(job, data.personal_keys) else None
    g = group if world > 1 else None
    life = Lifecycle(
        store=local_store(run_dir, rank=rank, world=world, group=group, stateful=kept is not None), unit="round",
        total=strat.rounds, label="Federated", state=lambda done: round_state(server, kept, done),
        checkpoint_every=job.run.checkpoint_every, group=None if is_buffered(job) else g, rank=rank, restart_count=ctx.restart_count,
        progress_every=job.run.progress_every, show=None if rank == 0 else False)
    start, found = restore(life, server, kept, resume=resume, rank=rank, world=world, group=g,
                           solo=kept is None)
    if rank == 0:
        run_dir = prepare_run_dir(job, resume=resume)
        metrics = MetricsWriter(run_dir)
    life.begin(start, resume=resume, found=found, metrics=metrics)
    barrier(group)
    return _Worker(ctx=ctx, job=job, data=data, host=host, store=store, comm_dev=comm_dev, tags=tags,
                   run_dir=Path(run_dir), server=server, metrics=metrics, life=life, traffic=CommCounter(),
                   started=started), start


def _round(w: _Worker, r: int) -> bool:
    """Round ``r`` on this rank (module docstring); False when the plan says stop."""
    t_round = time.perf_counter()
    strat: Any = w.job.strategy
    server, host, traffic = w.server, w.host, w.traffic
    if server is not None:
        plan: dict[str, Any] = {"stop": server.stopped, "clients": [], "lr_scale": server.schedule.factor()}
        if not server.stopped:
            plan["clients"] = select_clients(strat.client_selection, num_clients=strat.num_clients,
                                             round_idx=r, seed=w.job.run.seed, client_tags=w.tags)
        store_set_json(w.store, f"fed/plan/{r}", plan)
    else:  # the server's own plan needs no trip through the store
        plan = store_get_json(w.store, f"fed/plan/{r}")
    if plan["stop"]:
        return False
    sent_before = traffic.bytes.get("broadcast_delivered", 0)
    received = broadcast_state(w.data.template if server is None else server.global_state, w.data.template,
                               device=w.comm_dev, group=w.ctx.group, counter=traffic)
    control = (broadcast_control(server, w.data.template, group=w.ctx.group, device=w.comm_dev, counter=traffic)
               if uses_control(strat.aggregation) else None)
    wire_down = traffic.bytes.get("broadcast_delivered", 0) - sent_before
    glob = server.global_state if server is not None else received
    dev_state = {k: v.to(w.ctx.device) for k, v in glob.items()}
    lr_scale = float(plan.get("lr_scale", 1.0))
    results = [host.train_one(c, r, dev_state, lr_scale, control=control)
               for c in plan["clients"] if host.hosts(c)]
    statuses = [res.status() for res in results]
    if server is None:
        payload = b"".join(res.payload for res in results)
        store_set_json(w.store, f"fed/status/{r}/{w.ctx.rank}", {"results": statuses, "nbytes": len(payload)})
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
                else torch.zeros(0, dtype=torch.uint8))
        send_bytes(data, dst=0, group=w.ctx.group, counter=traffic, header=False)
        _evaluate(w, str(r))
        return True
    recv_before = traffic.bytes.get("recv", 0)
    all_st, all_pl = _collect(w, r, statuses, [res.payload for res in results])
    store_delete(w.store, f"fed/plan/{r - 1}")
    rec = server.finish_round(r, all_st, all_pl, wire_bytes_down=wire_down,
                              wire_bytes_up=traffic.bytes.get("recv", 0) - recv_before)
    d = w.data
    t_eval = time.perf_counter()
    ev, per = _evaluate(w, str(r))
    round_record(server, w.metrics, rec, ev, per, target=w.job.federated.target_accuracy, lr_scale=lr_scale,
                 eval_s=time.perf_counter() - t_eval, round_time_s=time.perf_counter() - t_round,
                 time_s=time.perf_counter() - w.started)
    fit = str(d.task.fitness_metric)
    w.life.show(r + 1, loss=rec.get("train_loss"),
                info=f"test_{fit} {ev.get(fit, float('nan')):.4g} ok {rec['clients_ok']}/{rec['clients_selected']}")
    return True


def _collect(w: _Worker, r: int, statuses: list[dict[str, Any]], payloads: list[bytes | memoryview],
             ) -> tuple[list[dict[str, Any]], list[bytes | memoryview]]:
    """Rank 0: its own clients' statuses and payloads, then every other rank's, in rank order."""
    all_st, all_pl = list(statuses), list(payloads)
    for src in range(1, w.ctx.world_size):
        key = f"fed/status/{r}/{src}"
        doc = store_get_json(w.store, key)
        store_delete(w.store, key)
        buf = recv_bytes(src=src, group=w.ctx.group, nbytes=int(doc["nbytes"]), max_bytes=1 << 34,
                         counter=w.traffic)
        all_st.extend(doc["results"])
        all_pl.extend(split_payload(doc["results"], buf))
    return all_st, all_pl


def _evaluate(w: _Worker, tag: str) -> tuple[dict[str, float], dict[str, Any]]:
    """Rank 0: :func:`.personal.round_metrics` of the global model; with personal parts every
    rank scores the clients it hosts (a collective: the others join it, their result empty)."""
    if w.server is not None:
        return round_metrics(w.data, w.server, lambda: _client_sums(w, tag), w.ctx.device)
    if w.data.personal_keys:
        _client_sums(w, tag)
    return {}, {}


def _client_sums(w: _Worker, tag: str) -> dict[int, dict[str, float]]:
    """Each client's evaluation sums on its own split, in client order (rank 0): without personal
    parts rank 0 scores every client; with them every rank scores its own (``w_G`` broadcast)
    and rank 0 gathers the others' sums through the store."""
    d, ctx, host = w.data, w.ctx, w.host
    glob = w.server.global_state if w.server is not None else d.template
    if host.personal is None:
        return score_clients(d, None, glob, range(len(d.partitions)), device=ctx.device)
    got = broadcast_state(glob, d.template, device=w.comm_dev, group=ctx.group, counter=w.traffic)
    sums = score_clients(d, host.personal, glob if w.server is not None else got, host.hosted, device=ctx.device)
    if w.server is None:
        store_set_json(w.store, f"fed/eval/{tag}/{ctx.rank}", {str(c): s for c, s in sums.items()})
        return {}
    for src in range(1, ctx.world_size):
        key = f"fed/eval/{tag}/{src}"
        sums.update({int(c): s for c, s in store_get_json(w.store, key).items()})
        store_delete(w.store, key)
    return dict(sorted(sums.items()))


def _summary(w: _Worker) -> dict[str, Any] | None:
    """After the last round: every rank's statistics, the final evaluation and each hosted
    client's model (collectives); rank 0 returns the summary."""
    ctx, job, d, server, traffic = w.ctx, w.job, w.data, w.server, w.traffic
    host, model = w.host, d.model
    stats: dict[str, Any] = {
        "rank": ctx.rank, "clients_hosted": len(host.hosted), "client_updates": host.trained,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "wire_bytes_sent_measured": traffic.bytes.get("send", 0) + traffic.bytes.get("broadcast_delivered", 0),
        "wire_bytes_received_measured": traffic.bytes.get("recv", 0)
        + traffic.bytes.get("broadcast_received", 0)}
    if host.personal is not None:
        stats["personal_sha256"] = host.personal.digest()
        stats["personal_clients_sha256"] = host.personal.client_digests()
    final, final_per = _evaluate(w, "final")
    if host.personal is not None:  # each hosted client's whole model
        save_client_models(w.run_dir, model, host.personal, broadcast_state(
            server.global_state if server is not None else w.data.template, w.data.template, device=w.comm_dev,
            group=ctx.group))
    if server is None:
        store_set_json(w.store, f"fed/final/{ctx.rank}", stats)
        barrier(ctx.group)
        return None
    workers = [stats] + [store_get_json(w.store, f"fed/final/{src}") for src in range(1, ctx.world_size)]
    barrier(ctx.group)
    extra: dict[str, Any] = dict(num_workers=ctx.world_size,
                                 client_updates_this_run=sum(x["client_updates"] for x in workers), workers=workers)
    if d.personal_keys:  # FedPer / FedBN: what never left the clients
        extra.update(local_subgraphs=local_paths(job, model), personal_keys=d.personal_keys,
                     server_state_keys=sorted(server.global_state), personal_sha256=personal_digest(workers))
    return finish_run(d, server, w.run_dir, final=final, final_per=final_per,
                      wall_s=time.perf_counter() - w.started,
                      initial=host.personal.initial if host.personal is not None else {}, head={}, extra=extra,
                      configured=("num_clients", "num_workers"), label="Federated")


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
