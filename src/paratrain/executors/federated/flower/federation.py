"""The server's view of the SuperNodes over Flower's ``Grid``: which node hosts which client,
one message per node per round, the replies, and every message's bytes (its serialized
objects, Flower's ``deflate``; HTTP framing not counted). Client ``c`` is hosted by the nodes
whose ``partition-id`` is ``c % num-partitions`` (stated in every reply). A round's message
goes to every connected node not heard from yet and to those hosting a selected client; the
round ends when every selected client has an answer (the first counts: a restarted SuperNode
takes its partition back while its old id still looks connected) or after ``round_timeout``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from torch import Tensor

from ....config import ConfigError
from ..client import ClientResult, client_name
from ..wire import split_payload
from . import protocol as P

log = logging.getLogger("paratrain.flower")


def message_nbytes(msg: Message) -> int:
    """The serialized bytes of ``msg``: every object Flower transfers for it."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


class Federation:
    """Rounds over the SuperNodes connected to a SuperLink (see the module docstring)."""

    def __init__(self, grid: Grid, job_json: str, opts: Any) -> None:
        self.grid, self.job_json, self.opts = grid, job_json, opts
        self.partition: dict[int, tuple[int, int]] = {}  # node id -> (partition-id, num-partitions)
        # where nodes with a state-dir keep their clients' state (.node_state); set by the round loop
        self.lineage: str | None = None
        self.keep_from = 0
        self.attempt = 0  # the server's resumes (flower.json): older attempts' saves are dropped
        self.restored: set[int] = set()  # partitions whose state came back from their disk

    def _where(self) -> dict[str, Any]:
        return {} if self.lineage is None else {P.LINEAGE: self.lineage, P.KEEP_FROM: int(self.keep_from),
                                               P.ATTEMPT: int(self.attempt)}

    def live(self) -> list[int]:
        """The connected node ids, once at least ``min_nodes`` are (waiting up to ``node_timeout``)."""
        deadline = time.monotonic() + float(self.opts.node_timeout)
        while True:
            live = sorted(int(n) for n in self.grid.get_node_ids())
            if len(live) >= int(self.opts.min_nodes):
                return live
            if time.monotonic() > deadline:
                raise ConfigError([("federated.flower.min_nodes", (
                    f"{len(live)} SuperNode(s) connected after {self.opts.node_timeout:g} s; the job "
                    f"needs {self.opts.min_nodes}"))])
            time.sleep(P.POLL_S)

    def targets(self, clients: Sequence[int]) -> list[int]:
        """The connected nodes that may host one of ``clients``."""
        out = []
        for n in self.live():
            known = self.partition.get(n)
            if known is None or any(c % known[1] == known[0] for c in clients):
                out.append(n)
        return out

    def exchange(self, msgs: list[Message], clients: set[int]) -> list[Message]:
        """Push ``msgs``; pull replies until every one of ``clients`` is answered for (or every
        message is) or ``round_timeout`` passed."""
        left = set(clients)

        def answered(got: list[Message]) -> bool:
            for m in got:
                if not m.has_error():
                    rec: Any = m.content.config_records[P.RESULT]
                    self.partition[int(m.metadata.src_node_id)] = (int(rec[P.PARTITION_ID]),
                                                                   int(rec[P.NUM_PARTITIONS]))
                    left.difference_update(int(c) for c in rec[P.CLIENTS])
            return not left

        return P.push_and_pull(self.grid, msgs, float(self.opts.round_timeout), answered)

    def _send(self, kind: str, clients: Sequence[int], plan: dict[str, Any], global_state: Mapping[str, Tensor],
              control: Mapping[str, Tensor] | None, group: str) -> tuple[list[Message], int, int, list[str]]:
        model = ArrayRecord(torch_state_dict=dict(global_state))
        ctl = ArrayRecord(torch_state_dict=dict(control)) if control else None
        msgs: list[Message] = []
        down = 0
        for node in self.targets(clients):
            content = RecordDict({P.PLAN: ConfigRecord({**plan, P.CLIENTS: list(clients)}), P.GLOBAL: model})
            if ctl is not None:
                content[P.CONTROL] = ctl
            msg = Message(content, dst_node_id=node, message_type=kind, group_id=group)
            down += message_nbytes(msg)
            msgs.append(msg)
        replies = self.exchange(msgs, set(clients)) if msgs else []
        up = sum(message_nbytes(m) for m in replies)
        errors = [f"SuperNode {m.metadata.src_node_id}: {m.error.reason}" for m in replies if m.has_error()]
        for e in errors:
            log.warning("%s", e)
        return [m for m in replies if not m.has_error()], down, up, errors

    def train(self, round_idx: int, clients: Sequence[int], global_state: Mapping[str, Tensor],
              lr_scale: float, control: Mapping[str, Tensor] | None,
              ) -> tuple[list[dict[str, Any]], list[bytes | memoryview], int, int]:
        """One round's training: every selected client's status and payload (failed where no
        node answered for it), and the bytes down and up."""
        plan = {P.JOB: self.job_json, P.ROUND: int(round_idx), P.LR_SCALE: float(lr_scale), **self._where()}
        replies, down, up, errors = self._send("train", clients, plan, global_state, control, f"train-{round_idx}")
        got: dict[int, tuple[dict[str, Any], bytes | memoryview]] = {}
        for rep in replies:
            rec: Any = rep.content.config_records[P.RESULT]
            if rec.get(P.RESUMED):
                self.restored.add(int(rec[P.PARTITION_ID]))
            statuses = json.loads(str(rec[P.STATUSES]))
            for st, pl in zip(statuses, split_payload(statuses, bytes(rec[P.PAYLOAD])), strict=True):
                got.setdefault(int(st["client"]), (st, pl))  # the first answer counts
        tail = f" ({'; '.join(errors)})" if errors else ""
        for c in clients:
            if c not in got:
                got[c] = (ClientResult(c, False, error=f"no SuperNode hosting {client_name(c)} replied within "
                                       f"round_timeout {self.opts.round_timeout:g} s{tail}").status(), b"")
        return [got[c][0] for c in clients], [got[c][1] for c in clients], down, up

    def dispatch(self, flight: Any, model: Mapping[str, Tensor]) -> tuple[list[str], int]:
        """FedBuff (:mod:`..buffered`): push one client's training from ``model`` to the nodes
        that may host it, without waiting; returns the message ids and the bytes down."""
        plan = {P.JOB: self.job_json, P.ROUND: int(flight.draw), P.LR_SCALE: float(flight.lr_scale),
                P.CLIENTS: [int(flight.client)], **self._where()}
        arrays = ArrayRecord(torch_state_dict=dict(model))
        msgs = [Message(RecordDict({P.PLAN: ConfigRecord(plan), P.GLOBAL: arrays}), dst_node_id=node,
                        message_type="train", group_id=f"fedbuff-{flight.seq}") for node in self.targets([flight.client])]
        return [i for i in self.grid.push_messages(msgs) if i], sum(message_nbytes(m) for m in msgs)

    def pull(self, ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | None, bytes, int]]:
        """The replies come for message ``ids``: ``(id, the client's status or None, its
        payload, the reply's bytes)``; a node's partition is noted from its reply."""
        out: list[tuple[str, dict[str, Any] | None, bytes, int]] = []
        for m in self.grid.pull_messages(list(ids)):
            st: dict[str, Any] | None = None
            pl = b""
            if not m.has_error():
                rec: Any = m.content.config_records[P.RESULT]
                self.partition[int(m.metadata.src_node_id)] = (int(rec[P.PARTITION_ID]), int(rec[P.NUM_PARTITIONS]))
                statuses = json.loads(str(rec[P.STATUSES]))
                if statuses:  # one client per FedBuff message
                    st, pl = statuses[0], bytes(rec[P.PAYLOAD])
            else:
                log.warning("SuperNode %s: %s", m.metadata.src_node_id, m.error.reason)
            out.append((m.metadata.reply_to_message_id, st, pl, message_nbytes(m)))
        return out

    def evaluate(self, tag: str, clients: Sequence[int], global_state: Mapping[str, Tensor],
                 entering: int = 0) -> tuple[dict[int, dict[str, float]], int, int]:
        """Each client's evaluation sums on its own test split, scored by its node with the
        clients' state entering round ``entering``."""
        plan = {P.JOB: self.job_json, P.ROUND: int(entering), **self._where()}
        replies, down, up, _ = self._send("evaluate", clients, plan, global_state, None, f"evaluate-{tag}")
        sums: dict[int, dict[str, float]] = {}
        for rep in replies:
            rec: Any = rep.content.config_records[P.RESULT]
            for c, s in json.loads(str(rec[P.SUMS])).items():
                sums.setdefault(int(c), s)
        return dict(sorted(sums.items())), down, up

    def train_secure(self, round_idx: int, clients: Sequence[int], global_state: Mapping[str, Tensor],
                     lr_scale: float, max_weight: float,
                     ) -> tuple[dict[str, Tensor] | None, list[dict[str, Any]], int, int, list[int]]:
        """A SecAgg+ round (:mod:`.secure`) over the nodes hosting ``clients``: the unmasked
        mean update (None when the protocol halted), every client's status, the bytes down and
        up, and how many nodes answered each stage."""
        from .secure import secure_round

        nodes = self.targets(clients)
        plan = {P.JOB: self.job_json, P.ROUND: int(round_idx), P.LR_SCALE: float(lr_scale),
                P.CLIENTS: json.dumps([int(c) for c in clients]), P.KEYS: json.dumps(list(global_state)),
                **self._where()}
        mean, got, down, up, answered = secure_round(self.grid, nodes, plan, global_state, self.opts, max_weight,
                                                     message_nbytes)
        by_client = {int(st["client"]): st for st in got}
        statuses = []
        for c in clients:
            st = by_client.get(int(c))
            if st is None or (mean is None and st.get("ok")):
                why = ("secure aggregation halted (too few nodes answered a SecAgg+ stage)" if mean is None
                       else f"no SuperNode hosting {client_name(c)} answered the secure round")
                st = ClientResult(int(c), False, error=why).status()
            statuses.append(st)
        return mean, statuses, down, up, answered
