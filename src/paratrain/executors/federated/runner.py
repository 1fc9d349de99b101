"""The round loop every worker process runs (rank 0 is also the server).

Per round ``r`` (DESIGN §4, Federated):

1. rank 0 selects clients and publishes the plan ``{"clients": [...], "stop": bool}``
   in the store (``fed/plan/r``);
2. the global model is broadcast from rank 0 (one flat float32 tensor, plus one int64
   tensor for integer buffers);
3. every rank trains the selected clients it hosts, one after another on its single
   model, publishes its status (``fed/status/r/rank``: per client ok, examples,
   loss, error, tensor headers, byte counts) and sends the concatenated payloads to
   rank 0 point-to-point;
4. rank 0 decodes, validates and aggregates, evaluates on the test set and logs the round;
5. every rank agrees on a stop (SIGINT/SIGTERM) and a due wall-time cadence; the round is
   the unit of the run's one lifecycle (:class:`~paratrain.training.lifecycle.Lifecycle`):
   when ``run.checkpoint_every`` (in rounds, 0: every round), that cadence, a stop or the
   last round says so, every process writes its part of ``checkpoints/step-<r+1>/`` (the
   server's state on rank 0, each rank's clients' codec state, personal parts and control
   variates: :mod:`.state`, which also resumes on another number of workers). A stop then
   ends the run (exit 130; ``--resume`` continues bit-identically).

What is trained is the job's :class:`~paratrain.task.Task` (classification by default):
the model from ``task.build_model``, the clients' data are their partitions
(:func:`~paratrain.data.partition.partition_dataset`, e.g. ``speaker``: one speaking role
per client) of the task's training set, the loss is the task's and the server evaluates
with the task's metrics. The plan of round ``r`` also carries ``lr_scale = f(r)`` from the
server's :class:`~.server.RoundSchedule` (``train.lr_schedule`` / ``warmup_steps`` over
rounds). The summary reports ``test_<metric>`` for every metric of the task,
``best_test_<fitness metric>`` and the task's reference metrics (``bigram_test_loss``).

With Local subgraphs (``[subgraphs.<path>] type = "Local"``: FedPer / FedBN, :mod:`.personal`)
the server's model lacks their keys, each client keeps its own part on the rank hosting it
(in that rank's worker checkpoint, every round), and after each round every rank scores its
clients on their own test splits (``personal_test_<metric>``; ``federated.evaluate_clients``
does the same for the global model).

A checkpoint is one collective write of every process, renamed into place when complete,
so a resume (``--resume`` or an elastic restart after a killed worker) finds the server and
every client of the same round and -- every random draw being a function of (seed, round,
client) -- ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ...comm.collectives import CommCounter
from ...comm.context import WorkerContext
from ...comm.federated_ops import (
    LocalStore,
    barrier,
    broadcast_,
    store_delete,
    store_get_json,
    store_set_json,
)
from ...comm.messages import recv_bytes, send_bytes
from ...config import ConfigError
from ...config.job import JobConfig
from ...data.client_splits import client_datasets
from ...data.partition import partition_dataset
from ...models.state import unique_state_dict
from ...subgraphs import local_paths, local_state_keys
from ...task import resolve_task
from ...training import MetricsWriter, prepare_run_dir, report, seed_everything, write_summary
from ...training.lifecycle import Lifecycle
from ...training.rundir import run_dir_of
from .checks import check_job, client_tags
from .client import ClientHost
from .drift import broadcast_control, uses_control
from .flat import flatten_state, unflatten_state
from .outputs import (
    final_global,
    peak_rss_mb,
    personal_digest,
    round_record,
    run_summary,
    save_client_models,
)
from .personal import ClientEvaluator, round_metrics
from .privacy import build_server_privacy
from .selection import select_clients
from .server import FederatedServer, RoundSchedule
from .state import fed_store, restore, round_state

__all__ = ["worker_main", "check_job", "client_tags", "KILL_ENV"]

# Fault injection for tests: "RANK:ROUND" makes that rank exit hard (os._exit) at the
# start of that round on the first attempt (TORCHELASTIC_RESTART_COUNT == 0), once the
# checkpoint writes in flight have landed.
KILL_ENV = "PARATRAIN_FED_KILL_RANK_AT_ROUND"


_INVOCATIONS = 0


class _Prefixed:
    """Key prefixing over a store's ``set``/``get``/``delete_key``."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        out: bytes = self.store.get(self.prefix + key)
        return out

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(self.prefix + key))


def worker_main(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any] | None:
    """Run the federated job on this rank; rank 0 returns the summary."""
    started = time.perf_counter()
    strat: Any = job.strategy
    if getattr(strat, "type", None) != "Federated":
        raise ConfigError([("strategy.type", f"federated executor got {getattr(strat, 'type', None)!r}")])
    check_job(job, world_size=ctx.world_size)
    rank, world, group = ctx.rank, ctx.world_size, ctx.group
    # Every rank calls worker_main the same number of times, so this counter agrees
    # across ranks and keeps a second job in the same processes (and store) from
    # reading the first job's control keys.
    global _INVOCATIONS
    _INVOCATIONS += 1
    base_store = ctx.store if ctx.store is not None else LocalStore()
    store = _Prefixed(base_store, f"fed{_INVOCATIONS}/")
    is_server = rank == 0
    seed = job.run.seed
    device = ctx.device
    # NCCL moves only device tensors; gloo takes CPU tensors.
    comm_dev = device if ctx.backend == "nccl" else torch.device("cpu")

    seed_everything(seed)
    task = resolve_task(job)
    train_set, test_set = task.datasets(seed)
    model = task.build_model(job.model, train_set)
    model.to(device)
    personal_keys = local_state_keys(model, job)  # Local subgraphs: personal to each client
    try:
        parts = partition_dataset(train_set, strat.num_clients, job.data.partition, seed=seed)
        per_client = bool(personal_keys) or job.federated.evaluate_clients
        splits: list[Any] = []
        if per_client or job.data.partition.feature_shift > 0:  # test splits follow the partition
            train_set, test_set, splits = client_datasets(train_set, test_set, parts, job.data.partition,
                                                          seed=seed)
    except ValueError as e:
        raise ConfigError([("data.partition", str(e))]) from None
    host = ClientHost(
        job, rank=rank, world_size=world, model=model, task=task, dataset=train_set,
        partitions=parts, device=device, personal_keys=personal_keys,
    )
    precision = job.train.precision
    fit = str(task.fitness_metric)
    # one entry per tensor: a tied weight is aggregated (and compressed) once
    # (the server's model: without the personal keys, which never leave their client)
    template = {k: v.detach().cpu().clone() for k, v in unique_state_dict(model).items()
                if k not in personal_keys}
    tags = client_tags(job, ctx)
    if getattr(strat.client_selection, "method", None) == "ByCapability":
        try:  # fail before any round, naming the tags, when no client can ever match
            select_clients(strat.client_selection, num_clients=strat.num_clients, round_idx=0,
                           seed=seed, client_tags=tags)
        except ValueError as e:
            raise ConfigError([("strategy.client_selection.required_tags", str(e).split(": ", 1)[-1])]) from None

    # Run folder: on resume nothing in it changes before the checkpoint was checked against
    # this job (every process, :func:`.state.restore`); then rank 0 creates (or keeps) it and
    # writes job.json, before anyone writes (the barrier below).
    run_dir = run_dir_of(job)
    server: FederatedServer | None = None
    metrics: MetricsWriter | None = None
    if is_server:
        schedule = RoundSchedule(job.train.lr_schedule, job.train.warmup_steps, strat.rounds)
        server = FederatedServer(strat.aggregation, template, schedule, num_clients=strat.num_clients)
        server.set_privacy(build_server_privacy(job, [len(p) for p in parts], tags))  # [federated.dp]
    # Codec state (error-feedback residuals), personal parts and SCAFFOLD's c_i of this
    # rank's clients travel in the checkpoint
    stateful = bool(personal_keys) or uses_control(strat.aggregation) or (
        job.compression is not None and getattr(job.compression, "method", "None") != "None")
    g = group if world > 1 else None
    life = Lifecycle(
        store=fed_store(run_dir, rank=rank, world=world, group=group, runtime="local"), unit="round",
        total=strat.rounds, label="Federated", state=lambda done: round_state(server, host if stateful else None, done),
        checkpoint_every=job.run.checkpoint_every, group=g, rank=rank, restart_count=ctx.restart_count,
        progress_every=job.run.progress_every, show=None if is_server else False)
    found = life.load() if resume else None
    start = restore(found, server, host if stateful else None, rank=rank, world=world, group=g)
    if is_server:
        run_dir = prepare_run_dir(job, resume=resume)
        metrics = MetricsWriter(run_dir)
    life.begin(start, resume=resume, found=found is not None, metrics=metrics)
    barrier(group)  # the run folder is ready before any rank writes

    kill = os.environ.get(KILL_ENV, "")
    kill_rank, kill_round = (int(v) for v in kill.split(":")) if kill else (-1, -1)
    target = job.federated.target_accuracy
    global_state = dict(template) if server is None else dict(server.global_state)
    traffic = CommCounter()  # this rank's process-group bytes, booked by the transport
    evaluator = None if not per_client else ClientEvaluator(
        model=model, personal=host.personal, task=task, dataset=test_set, splits=splits,
        hosted=host.hosted, num_clients=strat.num_clients, device=device, comm_device=comm_dev,
        precision=precision, rank=rank, world=world, group=group, store=store, counter=traffic)
    done = start

    with life:
        life.show(start)
        for r in range(start, strat.rounds):
            if rank == kill_rank and r == kill_round and ctx.restart_count == 0:
                life.wait()  # a crash after the last round: its checkpoint landed (asynchronous saves)
                os._exit(17)  # a hard crash, as a killed process would look
            t_round = time.perf_counter()
            if server is not None:
                plan: dict[str, Any] = {"stop": server.stopped, "clients": [],
                                        "lr_scale": server.schedule.factor()}
                if not server.stopped:
                    plan["clients"] = select_clients(
                        strat.client_selection, num_clients=strat.num_clients, round_idx=r,
                        seed=seed, client_tags=tags,
                    )
                store_set_json(store, f"fed/plan/{r}", plan)
            else:  # the server's own plan needs no trip through the store
                plan = store_get_json(store, f"fed/plan/{r}")
            if plan["stop"]:
                break
            # Global model down.
            if server is not None:
                fvec, ivec = flatten_state(server.global_state)
            else:
                fvec, ivec = flatten_state(template)
            if comm_dev.type != "cpu":
                fvec, ivec = fvec.to(comm_dev), ivec.to(comm_dev)
            sent_before = traffic.bytes.get("broadcast_delivered", 0)
            broadcast_(fvec, src=0, group=group, counter=traffic)
            if ivec.numel():
                broadcast_(ivec, src=0, group=group, counter=traffic)
            # SCAFFOLD: the server's control variate c goes down with the model
            control = (broadcast_control(server, template, group=group, device=comm_dev, counter=traffic)
                       if uses_control(strat.aggregation) else None)
            wire_down = traffic.bytes.get("broadcast_delivered", 0) - sent_before
            fvec, ivec = fvec.cpu(), ivec.cpu()
            global_state = server.global_state if server is not None else unflatten_state(template, fvec, ivec)
            dev_state = {k: v.to(device) for k, v in global_state.items()}
            # Local training of the selected clients this rank hosts.
            mine = [c for c in plan["clients"] if host.hosts(c)]
            lr_scale = float(plan.get("lr_scale", 1.0))
            results = [host.train_one(c, r, dev_state, lr_scale, control=control) for c in mine]
            statuses = [res.status() for res in results]
            payload = b"".join(res.payload for res in results)
            if server is None:
                store_set_json(store, f"fed/status/{r}/{rank}", {"results": statuses, "nbytes": len(payload)})
                data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
                        else torch.zeros(0, dtype=torch.uint8))
                send_bytes(data, dst=0, group=group, counter=traffic, header=False)
                if evaluator is not None and personal_keys:  # collective: score my clients
                    evaluator.run(str(r), global_state, template)
                done = r + 1
                life.end_unit(done, last=done == strat.rounds)
                continue
            # Server: collect every rank's updates.
            all_st = list(statuses)
            all_pl: list[bytes | memoryview] = [res.payload for res in results]
            recv_before = traffic.bytes.get("recv", 0)
            for src in range(1, world):
                key = f"fed/status/{r}/{src}"
                doc = store_get_json(store, key)
                store_delete(store, key)
                buf = recv_bytes(src=src, group=group, nbytes=int(doc["nbytes"]), max_bytes=1 << 34,
                                 counter=traffic)
                pos = 0
                for st in doc["results"]:
                    nb = int(st.get("nbytes", 0))
                    all_st.append(st)
                    all_pl.append(memoryview(buf)[pos : pos + nb])
                    pos += nb
            store_delete(store, f"fed/plan/{r - 1}")
            rec = server.finish_round(r, all_st, all_pl, wire_bytes_down=wire_down,
                                      wire_bytes_up=traffic.bytes.get("recv", 0) - recv_before)
            ev, per = round_metrics(server, evaluator, str(r), template, model, task, test_set, device, precision)
            round_record(server, rec, ev, per, target=target, lr_scale=lr_scale,
                         round_time_s=time.perf_counter() - t_round,
                         time_s=time.perf_counter() - started)
            assert metrics is not None
            metrics.log(dict(rec))
            life.show(r + 1, loss=rec.get("train_loss"),
                      info=f"test_{fit} {ev.get(fit, float('nan')):.4g} ok {rec['clients_ok']}/{rec['clients_selected']}")
            done = r + 1
            life.end_unit(done, last=done == strat.rounds)
    life.finish(done)  # stopped early (federated.target_accuracy): its checkpoint

    stats: dict[str, Any] = {
        "rank": rank, "clients_hosted": len(host.hosted), "client_updates": host.trained,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "wire_bytes_sent_measured": traffic.bytes.get("send", 0) + traffic.bytes.get("broadcast_delivered", 0),
        "wire_bytes_received_measured": traffic.bytes.get("recv", 0)
        + traffic.bytes.get("broadcast_received", 0)}
    if host.personal is not None:
        stats["personal_sha256"] = host.personal.digest()
        stats["personal_clients_sha256"] = host.personal.client_digests()
    final_eval = None
    if evaluator is not None and personal_keys:  # collective: every rank scores its clients
        final_eval = evaluator.run("final", global_state if server is None else server.global_state, template)
    if host.personal is not None and personal_keys:  # each hosted client's whole model
        save_client_models(run_dir, model, host.personal, final_global(
            server.global_state if server is not None else template, template, comm_dev, group))
    if server is None:
        store_set_json(store, f"fed/final/{rank}", stats)
        barrier(group)
        return None
    workers = [stats] + [store_get_json(store, f"fed/final/{src}") for src in range(1, world)]
    barrier(group)
    final, final_per = (final_eval if final_eval is not None else
                        round_metrics(server, evaluator, "final", template, model, task, test_set, device, precision))
    wall = time.perf_counter() - started
    updates = sum(w["client_updates"] for w in workers)
    if host.personal is not None:  # the global model's personal keys: their initial value,
        from ...models.state import load_unique_state_dict  # what a new client starts from

        whole = {**server.global_state, **host.personal.initial}
        load_unique_state_dict(model, {k: v.to(device) for k, v in whole.items()})
    summary = run_summary(job=job, task=task, server=server, model=model, run_dir=run_dir, final=final,
                          final_per=final_per, train_set=train_set, test_set=test_set, wall_s=wall)
    summary.update(num_workers=world, client_updates_this_run=updates, workers=workers)
    if personal_keys:  # FedPer / FedBN: what never left the clients
        summary.update(local_subgraphs=local_paths(job, model), personal_keys=personal_keys,
                       server_state_keys=sorted(server.global_state),
                       personal_sha256=personal_digest(workers))
    summary["provenance"] = report.provenance(summary, configured=("num_clients", "num_workers"))
    from ...training.export import save_model, whole_state

    save_model(run_dir, whole_state(model))  # the global model
    write_summary(run_dir, summary)
    report.plot_curves(run_dir, x_key="round", title=f"{job.run.name} (Federated, {strat.aggregation.method})")
    return summary
