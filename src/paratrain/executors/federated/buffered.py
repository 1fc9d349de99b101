"""FedBuff's server bookkeeping (Nguyen et al. 2022, "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS, Alg. 1), whatever carries the messages: ``concurrency``
clients in flight, each from the server version current when it was dispatched (its base);
an arriving update joins the buffer with its staleness ``s = version - base``; a full buffer
(``buffer_size``) is one server step (:class:`.aggregation.fedbuff.FedBuffAggregator`) and one
logged "round"; a freed slot goes to the next client.

The next client is the next position of an endless sequence of draws: draw ``q`` is
``client_selection``'s set for round ``q`` (:func:`.selection.select_clients`, a function of
``(seed, q)``), position ``p`` its member ``p mod |draw|``; a client still in flight is passed
over (a device trains one job at a time). The client trains with the generator of ``(seed, q,
client)``, so with ``buffer_size = concurrency = |draw|`` and every client of a version
arriving before the next is dispatched, version ``q`` is FedAvg's round ``q`` bit for bit.
Which arrivals fill a buffer is the runtime's: it hands them over in dispatch order. The
state (:meth:`Buffered.state_dict`) holds the cursor, the buffer (statuses and payloads as
received), each in-flight client's base version and the models of those versions, so a
resumed server dispatches the same clients from the same models again.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from ...config.job import JobConfig
from .aggregation.fedbuff import staleness_weight
from .selection import select_clients
from .state import round_record


def is_buffered(job: JobConfig) -> bool:
    return getattr(getattr(job.strategy, "aggregation", None), "method", None) == "FedBuff"


def fedbuff_problems(job: JobConfig, tags: Mapping[int, Any]) -> list[tuple[str, str]]:
    """FedBuff's option values that cannot work with the job, naming the field."""
    if not is_buffered(job):
        return []
    s: Any = job.strategy
    agg, out = s.aggregation, []
    per_draw = len(select_clients(s.client_selection, num_clients=s.num_clients, round_idx=0,
                                  seed=job.run.seed, client_tags=tags))
    if agg.concurrency > per_draw:
        out.append(("strategy.aggregation.concurrency", (
            f"{agg.concurrency} clients in flight but client_selection ({s.client_selection.method}) "
            f"draws {per_draw} of the {s.num_clients} clients at a time")))
    if agg.buffer_size > agg.concurrency:
        out.append(("strategy.aggregation.buffer_size", (
            f"{agg.buffer_size} updates per step but only concurrency = {agg.concurrency} clients in flight")))
    why = {"federated.dp": job.federated.dp is not None and "its privacy is accounted per synchronous round",
           "compression": job.compression is not None and getattr(job.compression, "method", "None") != "None"
           and "a compressed client keeps a codec state between its updates",
           "subgraphs": bool(job.subgraphs) and "a client's personal parts are state it keeps between updates"}
    out += [(k, f"not supported with FedBuff: {v} (FedBuff's clients are stateless)") for k, v in why.items() if v]
    return out


@dataclass
class Flight:
    """A dispatched client: its dispatch number, base version, draw and learning-rate scale."""

    seq: int
    client: int
    base: int
    draw: int
    lr_scale: float


class Buffered:
    """The module docstring's state and rules (the server's ``buffered``)."""

    def __init__(self, job: JobConfig, tags: Mapping[int, Any]) -> None:
        s: Any = job.strategy
        self.size, self.concurrency, self.kind = s.aggregation.buffer_size, s.aggregation.concurrency, s.aggregation.staleness
        self.select = lambda q: select_clients(s.client_selection, num_clients=s.num_clients, round_idx=q,
                                               seed=job.run.seed, client_tags=tags)
        self.per = len(self.select(0))  # clients per draw, the same for every draw
        self.cursor = self.seq = 0
        self.flights: dict[int, Flight] = {}
        self.buffer: list[tuple[dict[str, Any], bytes]] = []
        self.bases: dict[int, dict[str, Tensor]] = {}  # the models the clients in flight started from

    def fill(self, version: int, model: dict[str, Tensor], lr_scale: float) -> list[Flight]:
        """Dispatch the next clients into the free slots at ``version`` (``model``)."""
        busy = {f.client for f in self.flights.values()}
        new: list[Flight] = []
        while len(self.flights) < self.concurrency:  # a draw holds >= concurrency clients: it ends
            q, i = divmod(self.cursor, self.per)
            c = self.select(q)[i]  # (a permutation of num_clients: cheap beside a client's training)
            self.cursor += 1
            if c in busy:
                continue
            f = Flight(self.seq, c, version, q, lr_scale)
            self.seq += 1
            self.flights[f.seq] = f
            busy.add(c)
            new.append(f)
        if new:
            self.bases[version] = model
        return new

    def arrive(self, seq: int, status: Mapping[str, Any], payload: bytes | memoryview, version: int) -> bool:
        """Book the update of dispatch ``seq`` at server ``version``; True: the buffer is full."""
        f = self.flights.pop(seq)
        s = version - f.base
        self.buffer.append(({**status, "seq": seq, "base_version": f.base, "staleness": s,
                             "staleness_weight": staleness_weight(s, self.kind)}, bytes(payload)))
        kept = {g.base for g in self.flights.values()}
        self.bases = {v: m for v, m in self.bases.items() if v in kept}
        return len(self.buffer) >= self.size

    def take(self) -> tuple[list[dict[str, Any]], list[bytes]]:
        """The full buffer's statuses and payloads (emptied)."""
        got, self.buffer = self.buffer, []
        return [st for st, _ in got], [pl for _, pl in got]

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "seq": self.seq,
                "flights": json.dumps([asdict(f) for f in self.flights.values()]),
                "statuses": json.dumps([st for st, _ in self.buffer]),
                "payloads": {str(i): torch.frombuffer(bytearray(pl), dtype=torch.uint8) if pl
                             else torch.zeros(0, dtype=torch.uint8) for i, (_, pl) in enumerate(self.buffer)},
                "bases": {str(v): dict(m) for v, m in self.bases.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor, self.seq = int(state["cursor"]), int(state["seq"])
        self.flights = {f["seq"]: Flight(**f) for f in json.loads(state["flights"])}
        pays = dict(state.get("payloads") or {})
        self.buffer = [(st, bytes(pays[str(i)].numpy().tobytes()) if str(i) in pays else b"")
                       for i, st in enumerate(json.loads(state["statuses"]))]
        self.bases = {int(v): dict(m) for v, m in dict(state.get("bases") or {}).items()}


Arrival = tuple[int, dict[str, Any], "bytes | memoryview"]  # (dispatch number, status, payload)


class BufferedLoop(ABC):
    """A runtime's FedBuff server loop: the runtime's :meth:`dispatch` (start clients) and
    :meth:`collect` (the updates at hand, waiting for one only when none is, in dispatch order)
    around the rules above; every version is logged, evaluated and checkpointed as a round."""

    def __init__(self, server: Any, job: JobConfig, life: Any, metrics: Any,
                 evaluate: Callable[[str], tuple[dict[str, float], dict[str, Any]]], started: float,
                 fitness: str, **extra: Any) -> None:
        self.server, self.job, self.life, self.metrics, self.evaluate = server, job, life, metrics, evaluate
        self.buf: Buffered = server.buffered
        self.started, self.fitness, self.extra = started, fitness, extra

    @abstractmethod
    def dispatch(self, flights: list[Flight]) -> None:
        """Send ``flights`` to be trained (the runtime's transport)."""

    @abstractmethod
    def collect(self) -> list[Arrival]:
        """The updates at hand (blocking only when none is)."""

    @abstractmethod
    def wire(self) -> tuple[int, int]:
        """The bytes the transport moved down and up since the last call."""

    def run(self, start: int) -> int:
        """Versions until ``strategy.rounds`` (or the target accuracy); returns the versions done."""
        server, buf, rounds = self.server, self.buf, self.job.strategy.rounds  # type: ignore[union-attr]
        done = start
        if done >= rounds or server.stopped:
            return done
        # resumed: the clients in flight again, from their bases; their updates come before a refill
        self.dispatch(sorted(buf.flights.values(), key=lambda f: f.seq)
                      or buf.fill(server.round, server.global_state, server.schedule.factor()))
        while True:
            for seq, status, payload in self.collect():
                if buf.arrive(seq, status, payload, server.round):
                    done = self.step()
                    if done >= rounds or server.stopped:
                        return done
            self.dispatch(buf.fill(server.round, server.global_state, server.schedule.factor()))

    def step(self) -> int:
        """Apply the full buffer as the next version: logged, evaluated, maybe checkpointed."""
        server = self.server
        statuses, payloads = self.buf.take()
        version, lr_scale = server.round, server.schedule.factor()
        down, up = self.wire()
        rec = server.finish_round(version, statuses, payloads, wire_bytes_down=down, wire_bytes_up=up)
        rec["buffer"] = [{k: st.get(k) for k in ("client", "seq", "base_version", "staleness", "staleness_weight")}
                         for st in statuses]
        rec["staleness_max"] = max(int(st["staleness"]) for st in statuses)
        t_eval = time.perf_counter()
        ev, per = self.evaluate(str(version))
        round_record(server, self.metrics, rec, ev, per, target=self.job.federated.target_accuracy,
                     lr_scale=lr_scale, eval_s=time.perf_counter() - t_eval, time_s=time.perf_counter() - self.started,
                     in_flight=len(self.buf.flights), **self.extra)
        done = version + 1
        self.life.show(done, loss=rec.get("train_loss"), info=f"test_{self.fitness} "
                       f"{ev.get(self.fitness, float('nan')):.4g} staleness<={rec['staleness_max']}")
        self.life.end_unit(done, last=done == self.job.strategy.rounds)  # type: ignore[union-attr]
        return done
