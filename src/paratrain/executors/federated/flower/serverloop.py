"""paratrain's federated round loop over Flower's Deployment Runtime (server side, no
Flower import: the nodes are reached through a :class:`~.federation.Federation`). It selects
clients, aggregates (:class:`~..server.FederatedServer`) and checkpoints as the local path
does, so a restarted ServerApp with ``resume = true`` continues bit-identically; the clients'
state lives on the nodes (:mod:`.node_state`).
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ....config import ConfigError
from ....config.job import JobConfig
from ....files import step_folders, write_json
from ....training.lifecycle import Lifecycle
from ....training.rundir import MetricsWriter, RunFolder
from ....training.threads import use_threads
from ..buffered import Arrival, Buffered, BufferedLoop, Flight, is_buffered
from ..client import ClientResult, client_name
from ..personal import round_metrics
from ..privacy import build_server_privacy
from ..selection import select_clients
from ..server import FederatedServer, RoundSchedule, mean_loss
from ..state import fed_store, finish_run, restore, round_record, round_state
from ..wire import encode_update
from . import protocol as P
from .side import Side, build_side, stateful

if TYPE_CHECKING:  # the loop itself imports no Flower
    from .federation import Federation as Nodes


def _lineage(run_dir: Path) -> tuple[str, int]:
    """The run's lineage id (drawn with the run folder, kept across resumes) and attempt (its
    resumes), in ``flower.json`` (:mod:`.node_state`)."""
    path = run_dir / "flower.json"
    try:
        doc = json.loads(path.read_text()) if path.exists() else {}
        got, attempt = doc.get("lineage"), int(doc.get("attempt", 0)) + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        got, attempt = None, 0
        warnings.warn(f"{path} is unreadable ({e!r}): the nodes keep their clients' state under a new "
                      "lineage (state kept under the old one is not resumed)", stacklevel=2)
    if not (isinstance(got, str) and got):
        got, attempt = uuid.uuid4().hex[:16], 0
    write_json(path, {"lineage": got, "attempt": attempt})
    return got, attempt


def _oldest_kept(run_dir: Path, default: int) -> int:
    """The step (rounds done) of the oldest checkpoint kept: the earliest a resume restarts at."""
    steps = [int(p.name.split("-")[1]) for p in step_folders(run_dir / "checkpoints")]
    return min(steps) if steps else default


def _evaluate(side: Side, server: FederatedServer, nodes: Nodes, tag: str,
              entering: int) -> tuple[dict[str, float], dict[str, Any]]:
    """:func:`..personal.round_metrics`, the clients scored by their nodes."""
    def client_sums() -> dict[int, dict[str, float]]:
        sums, _, _ = nodes.evaluate(tag, range(len(side.partitions)), server.global_state, entering)
        return {c: s for c, s in sums.items() if len(side.splits[c])}

    return round_metrics(side, server, client_sums, torch.device("cpu"))


def run_server(nodes: Nodes, job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run ``job`` over ``nodes``; returns the summary (also in ``runs/<name>/summary.json``)."""
    started = time.perf_counter()
    strat: Any = job.strategy
    with use_threads(1):  # as the local path's server (one intra-op thread on CPU)
        side = build_side(job)
        schedule = RoundSchedule(job.train.lr_schedule, job.train.warmup_steps, strat.rounds)
        server = FederatedServer(strat.aggregation, side.template, schedule, num_clients=strat.num_clients)
        tags = {c: sorted(job.federated.client_tags.get(client_name(c), [])) for c in range(strat.num_clients)}
        server.set_privacy(build_server_privacy(job, [len(p) for p in side.partitions], tags))  # [federated.dp]
        server.buffered = Buffered(job, tags) if is_buffered(job) else None
        with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
            run_dir = folder.path
            life = Lifecycle(store=fed_store(run_dir, rank=0, world=1, group=None, runtime="flower"),
                             unit="round", total=strat.rounds, label="Federated (Flower)",
                             state=lambda done: round_state(server, None, done),
                             checkpoint_every=job.run.checkpoint_every, show=False)
            start, found = restore(life, server, None, resume=resume)
            folder.prepare()
            nodes.lineage, nodes.attempt = _lineage(run_dir)
            metrics = MetricsWriter(run_dir)
            life.begin(start, resume=resume, found=found, metrics=metrics)
            secure = getattr(job.federated.flower, "secure_aggregation", None) is not None
            # the last round's scores, by the round entered: the final scores when no round followed
            # (with per-client scores, a second asking would be one evaluate message per node)
            scored: dict[int, tuple[dict[str, float], dict[str, Any]]] = {}
            with life:
                if server.buffered is not None:  # FedBuff: versions as replies come
                    _FlowerBuffered(server, job, life, metrics, lambda tag: _evaluate(side, server, nodes, tag, server.round),
                                    started, str(side.task.fitness_metric), nodes).run(start)
                for r in range(start, start if server.buffered is not None else strat.rounds):
                    if server.stopped:
                        break
                    t_round = time.perf_counter()
                    try:
                        clients = select_clients(strat.client_selection, num_clients=strat.num_clients,
                                                 round_idx=r, seed=job.run.seed, client_tags=tags)
                    except ValueError as e:
                        raise ConfigError([("strategy.client_selection", str(e))]) from None
                    nodes.keep_from = _oldest_kept(run_dir, r)
                    lr_scale = server.schedule.factor()
                    control = server.control()  # SCAFFOLD's c, down with the model ({} otherwise)
                    if secure:
                        rec = _secure_round(side, server, nodes, r, clients, lr_scale)
                    else:
                        statuses, payloads, down, up = nodes.train(r, clients, server.global_state, lr_scale,
                                                                   control or None)
                        rec = server.finish_round(r, statuses, payloads, wire_bytes_down=down, wire_bytes_up=up)
                    ev, per = _evaluate(side, server, nodes, str(r), r + 1)
                    scored = {r + 1: (ev, per)}  # scored as the clients entering round r + 1
                    round_record(server, metrics, rec, ev, per, target=job.federated.target_accuracy, lr_scale=lr_scale,
                                 runtime="flower", round_time_s=time.perf_counter() - t_round,
                                 time_s=time.perf_counter() - started)
                    life.end_unit(r + 1, last=r + 1 == strat.rounds or server.stopped)
            life.finish(server.round)
            return _finish(side, server, nodes, run_dir, started, resumed_from=start if resume else None,
                           scored=scored.get(server.round))


class _FlowerBuffered(BufferedLoop):
    """FedBuff over the Grid (:mod:`..buffered`): one train message per dispatched client, to
    the nodes that may host it, pushed without waiting; the replies pulled as they come (the
    hosting node's counts). A client whose node has not answered within ``round_timeout`` is a
    failed update (it still fills its place in the buffer)."""

    def __init__(self, *args: Any) -> None:
        *base, self.nodes = args
        super().__init__(*base, runtime="flower")
        self.owner: dict[str, int] = {}  # message id -> dispatch number (until its reply comes)
        self.waiting: dict[int, tuple[set[str], float]] = {}  # dispatch -> (messages unanswered, deadline)
        self.bytes = [0, 0]  # down, up since the last version

    def dispatch(self, flights: list[Flight]) -> None:
        timeout = float(self.nodes.opts.round_timeout)
        for f in flights:
            ids, down = self.nodes.dispatch(f, self.buf.bases[f.base])
            self.bytes[0] += down
            self.owner.update(dict.fromkeys(ids, f.seq))
            self.waiting[f.seq] = (set(ids), time.monotonic() + timeout)

    def collect(self) -> list[Arrival]:
        wait = P.POLL_S
        while True:
            got: list[Arrival] = []
            for mid, st, pl, nbytes in self.nodes.pull(list(self.owner)):
                seq = self.owner.pop(mid, None)
                self.bytes[1] += nbytes
                if seq in self.waiting:
                    self.waiting[seq][0].discard(mid)
                    if st is not None:
                        got.append((seq, st, pl))
                        del self.waiting[seq]
            now = time.monotonic()
            for seq, (ids, deadline) in list(self.waiting.items()):
                if not ids or now > deadline:  # every node answered without it, or too late
                    c = self.buf.flights[seq].client
                    got.append((seq, ClientResult(c, False, error=f"no SuperNode hosting {client_name(c)} "
                                                  f"replied within round_timeout").status(), b""))
                    del self.waiting[seq]
            if got:
                return sorted(got, key=lambda g: g[0])
            time.sleep(wait)  # as push_and_pull: back off while nothing comes
            wait = min(wait * 1.5, 1.0)

    def wire(self) -> tuple[int, int]:
        (down, up), self.bytes = self.bytes, [0, 0]
        return down, up


def _secure_round(side: Side, server: FederatedServer, nodes: Nodes, r: int, clients: list[int],
                  lr_scale: float) -> dict[str, Any]:
    """A SecAgg+ round: the unmasked mean update goes to the FederatedServer as one update of
    weight ``sum n_c``; the round's record then counts the clients themselves."""
    max_weight = float(sum(len(side.partitions[c]) for c in clients)) or 1.0
    mean, statuses, down, up, answered = nodes.train_secure(r, clients, server.global_state, lr_scale, max_weight)
    ok = [st for st in statuses if st.get("ok")]
    failed = [st for st in statuses if not st.get("ok")]
    one: list[dict[str, Any]] = list(failed)
    payloads: list[bytes | memoryview] = [b""] * len(failed)
    if mean is not None and ok:
        headers, payload = encode_update(mean)
        total = sum(int(st["n"]) for st in ok)
        one.append({"client": int(ok[0]["client"]), "ok": True, "n": total, "loss": None, "headers": headers,
                    "nbytes": len(payload)})
        payloads.append(payload)
    rec = server.finish_round(r, one, payloads, wire_bytes_down=down, wire_bytes_up=up)
    losses = [(float(st["loss"]), float(st["n"])) for st in ok if st.get("loss") is not None]
    rec.update(clients_selected=len(clients), clients_ok=len(ok) if mean is not None else 0,
               secure_aggregation="SecAgg+", bytes_up_measured=up,
               secagg_nodes_per_stage=answered)  # setup, share keys, masked vectors, unmask
    if losses:
        rec["train_loss"] = mean_loss(losses)
    return rec


def _finish(side: Side, server: FederatedServer, nodes: Nodes, run_dir: Any, started: float,
            resumed_from: int | None,
            scored: tuple[dict[str, float], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The run's end (:func:`..state.finish_run`); ``scored``: the scores of the model as it is
    (the last round's), else it is scored again."""
    from ....models.state import unique_state_dict

    final, final_per = scored if scored is not None else _evaluate(side, server, nodes, "final", server.round)
    own = unique_state_dict(side.model)  # the server never trains: its personal keys are their initial value
    extra: dict[str, Any] = {}
    if resumed_from is not None:
        extra["resumed_from_round"] = resumed_from
        if resumed_from > 0 and stateful(side.job, side.personal_keys):
            extra["client_state_restored_partitions"] = sorted(nodes.restored)
            if not nodes.restored:
                extra["resume_note"] = (
                    "the clients' own state (personal parts, error-feedback residuals, control "
                    "variates) was in each node's Flower context of the interrupted run and no node "
                    "had it on disk (start the SuperNodes with --node-config state-dir=...): the "
                    "resumed run's clients started it afresh")
    return finish_run(side, server, run_dir, final=final, final_per=final_per,
                      wall_s=time.perf_counter() - started,
                      initial={k: own[k] for k in side.personal_keys},
                      head={"runtime": "flower"}, extra=extra, configured=("num_clients",),
                      label="Federated on Flower")
