"""FedBuff on the local runtime (rules: :mod:`.buffered`). One process: rank 0 is the server
and trains every client it dispatches, in dispatch order, before it collects. Several: the
dispatched clients wait in one queue on rank 0 and each other rank holds one client at a
time: the oldest queued client goes to a free rank as one message (the base model, unless
that rank already holds that version), posted without waiting, and a rank that replies
(:class:`~paratrain.comm.messages.AnySource`) is handed the next queued client at once. So a
slow client holds one rank and delays no other client (any rank trains any client: FedBuff's
clients are stateless, every rank holds every client's partition). Rank 0 trains the oldest
queued client itself only when no update is at hand (instead of waiting; the replies that
come meanwhile wait for it). A queued client is already in flight: its base is the version
at its dispatch. Each pass of the loop takes the updates at hand, books them in dispatch
order, steps whenever the buffer is full, then refills the free slots.

Only rank 0 keeps the lifecycle (one version = one "round": evaluated, logged, checkpointed):
the workers keep no state. At the end, and on SIGINT/SIGTERM, rank 0 sends every worker a
stop after the client it holds and takes the replies still due (their updates unused: the
clients in flight, queued or training, are in the checkpoint, dispatched again on resume).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...comm.messages import AnySource, PendingSends, recv_bytes, send_bytes
from ...training.lifecycle import Interrupted
from .buffered import BufferedLoop, Flight
from .wire import decode_update, dense_headers, encode_update, frame, unframe

_MAX_BYTES = 1 << 34


def train(w: Any, doc: dict[str, Any], model: dict[str, torch.Tensor]) -> tuple[dict[str, Any], bytes]:
    """One dispatched client's update: its status and payload."""
    res = w.host.train_one(int(doc["client"]), int(doc["draw"]), {k: v.to(w.ctx.device) for k, v in model.items()},
                           float(doc["lr_scale"]))
    return res.status(), res.payload


def _doc(f: Flight) -> dict[str, Any]:
    return {"seq": f.seq, "client": f.client, "draw": f.draw, "lr_scale": f.lr_scale, "version": f.base}


class _Server(BufferedLoop):
    """Rank 0's loop (module docstring)."""

    def __init__(self, w: Any, evaluate: Callable[[Any, str], Any]) -> None:
        super().__init__(w.server, w.job, w.life, w.metrics, lambda tag: evaluate(w, tag), w.started,
                         str(w.data.task.fitness_metric))
        self.w, self.world = w, w.ctx.world_size
        self.counted = (0, 0)  # the transport's bytes sent and received at the last version
        self.sends = PendingSends(w.ctx.group, w.traffic)
        self.inbox = AnySource(w.ctx.group, max_bytes=_MAX_BYTES, counter=w.traffic)
        self.at_hand: list[tuple[int, dict[str, Any], bytes | memoryview]] = []  # rank 0's own updates
        self.queue: list[Flight] = []  # dispatched clients no rank holds yet, oldest first
        self.free = list(range(1, self.world)) or [0]  # the training ranks holding no client
        self.owed = 0  # replies the workers owe
        self.holds: dict[int, int] = {}  # rank -> the model version it holds

    def dispatch(self, flights: list[Flight]) -> None:
        self.queue += flights
        self.hand()

    def here(self, f: Flight) -> tuple[int, dict[str, Any], bytes | memoryview]:
        """Train queued client ``f`` on rank 0: its dispatch number, status and payload."""
        return (f.seq, *train(self.w, _doc(f), self.buf.bases[f.base]))

    def hand(self) -> None:
        """The queued clients to the free ranks (one process: trained here, all of them)."""
        while self.queue and self.free:
            f, rank = self.queue.pop(0), self.free[0]
            if rank == 0:
                self.at_hand.append(self.here(f))
                continue
            self.free.pop(0)
            doc = {**_doc(f), "model": self.holds.get(rank) != f.base}
            self.holds[rank] = f.base
            self.sends.post(frame(doc, encode_update(self.buf.bases[f.base])[1] if doc["model"] else b""), dst=rank)
            self.inbox.expect()
            self.owed += 1

    def collect(self) -> list[tuple[int, dict[str, Any], bytes | memoryview]]:
        """The updates at hand, in dispatch order; with none, rank 0 trains the oldest queued
        client, or waits for a reply when none is queued. A rank that replies gets the next
        queued client before its update is booked."""
        got, self.at_hand = self.at_hand, []
        while self.owed:
            one = self.inbox.take(block=not (got or self.queue))
            if one is None:
                if got:
                    break
                got.append(self.here(self.queue.pop(0)))
                continue
            self.owed -= 1
            self.free.append(one[0])
            self.hand()
            doc, payload = unframe(one[1])
            got.append((int(doc["seq"]), doc["status"], payload))
        return sorted(got, key=lambda g: g[0])

    def wire(self) -> tuple[int, int]:
        sent, got = self.w.traffic.bytes.get("send", 0), self.w.traffic.bytes.get("recv", 0)
        down, up = sent - self.counted[0], got - self.counted[1]
        self.counted = (sent, got)
        return down, up

    def finish(self, interrupted: str | None = None) -> None:
        """Stop every worker after the client it holds; take the replies still owed."""
        for rank in range(1, self.world):
            self.sends.post(frame({"stop": True, "interrupted": interrupted, "version": self.server.round}), dst=rank)
        while self.owed:
            self.inbox.take(block=True)
            self.owed -= 1
        self.inbox.close()
        self.sends.wait()


def run_buffered(w: Any, start: int, evaluate: Callable[[Any, str], Any]) -> int:
    """This rank's part of a FedBuff run from version ``start``; returns the versions done
    (rank 0's count; a worker returns ``start``)."""
    if w.server is None:
        _work(w)
        return start
    loop = _Server(w, evaluate)
    try:
        done = loop.run(start)
    except Interrupted as e:
        loop.finish(interrupted=e.signame)
        raise
    loop.finish()
    return done


def _work(w: Any) -> None:
    """A worker: train each dispatch in turn and send its update to rank 0, until a stop."""
    headers = dense_headers(w.data.template)
    model: dict[str, torch.Tensor] = {}
    while True:
        doc, payload = unframe(recv_bytes(src=0, group=w.ctx.group, max_bytes=_MAX_BYTES, counter=w.traffic))
        if doc.get("stop"):
            if doc.get("interrupted"):
                raise Interrupted(str(doc["interrupted"]), int(doc["version"]), "round")
            return
        if doc["model"]:
            got = decode_update("server", headers, payload, w.data.template)
            model = {k: got[k].to(t.dtype) for k, t in w.data.template.items()}
        status, update = train(w, doc, model)
        send_bytes(frame({"seq": doc["seq"], "status": status}, update), dst=0, group=w.ctx.group,
                   counter=w.traffic)
