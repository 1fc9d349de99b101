"""The server's view of the SuperNodes over Flower's ``Grid``: which node hosts which
client, one train (or evaluate) message per node per round, the replies, and the bytes of
every message.

Membership. Each round the server lists the connected nodes (``grid.get_node_ids()``); a
node it has not seen is asked (a ``query`` message) for its ``partition-id`` and
``num-partitions``; client ``c`` is hosted by the node of partition ``c % num-partitions``
(the newest such node: a SuperNode that restarts registers under a new node id and takes its
partition back). A node whose ``num-partitions`` differs from the first node's is left out
(logged). A selected client with no connected node, or whose node has not replied within
``[federated.flower] round_timeout`` (a node killed mid-round), or answered with an error, is
a failed client of that round: the round goes on with the others, as on the local path.

Bytes are measured at the Message level: the serialized size of every object of a message
(Flower's ``deflate`` of the message, its records and arrays), summed over the messages the
server pushes (down) and the replies it pulls (up); HTTP framing is not counted."""

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
from ..client import client_name
from . import protocol as P

__all__ = ["Federation", "message_nbytes"]

log = logging.getLogger("paratrain.flower")
POLL_S = 0.1  # seconds between pulls of the replies


def message_nbytes(msg: Message) -> int:
    """The serialized bytes of ``msg``: every object Flower transfers for it."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


class Federation:
    """Rounds over the SuperNodes connected to a SuperLink (see the module docstring)."""

    def __init__(self, grid: Grid, job_json: str, opts: Any) -> None:
        self.grid, self.job_json, self.opts = grid, job_json, opts
        self.nodes: dict[int, tuple[int, int, int]] = {}  # node id -> (partition, partitions, seen order)
        self.ignored: set[int] = set()
        self.seen = 0
        self.num_partitions: int | None = None

    # ------------------------------------------------------------------ membership

    def _live(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def refresh(self) -> list[int]:
        """Wait for ``min_nodes`` connected nodes (up to ``node_timeout``), ask the new ones
        their partition; returns the connected node ids."""
        deadline = time.monotonic() + float(self.opts.node_timeout)
        live = self._live()
        while len(live) < int(self.opts.min_nodes):
            if time.monotonic() > deadline:
                raise ConfigError([("federated.flower.min_nodes", (
                    f"{len(live)} SuperNode(s) connected after {self.opts.node_timeout:g} s; the job "
                    f"needs {self.opts.min_nodes}"))])
            time.sleep(0.25)
            live = self._live()
        new = [n for n in live if n not in self.nodes and n not in self.ignored]
        if new:
            msgs = [Message(RecordDict({P.NODE: ConfigRecord({})}), dst_node_id=n, message_type="query")
                    for n in new]
            for rep in self.exchange(msgs):
                src = int(rep.metadata.src_node_id)
                if rep.has_error():
                    log.warning("SuperNode %d cannot take part: %s", src, rep.error.reason)
                    self.ignored.add(src)
                    continue
                rec: Any = rep.content.config_records[P.NODE]
                part, parts = int(rec[P.PARTITION_ID]), int(rec[P.NUM_PARTITIONS])
                if self.num_partitions is None:
                    self.num_partitions = parts
                if parts != self.num_partitions:
                    log.warning("SuperNode %d says num-partitions = %d, the federation's is %d: left out",
                                src, parts, self.num_partitions)
                    self.ignored.add(src)
                    continue
                self.seen += 1
                self.nodes[src] = (part, parts, self.seen)
        alive = set(live)
        self.nodes = {n: v for n, v in self.nodes.items() if n in alive}
        return live

    def exchange(self, msgs: list[Message]) -> list[Message]:
        """Push ``msgs`` and pull their replies until all arrived or ``round_timeout`` passed
        (Flower's ``send_and_receive`` with a short poll: its own waits 3 s between pulls)."""
        pending = {i for i in self.grid.push_messages(msgs) if i}
        deadline = time.monotonic() + float(self.opts.round_timeout)
        out: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(list(pending)))
            out.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return out

    def owner(self, client: int) -> int | None:
        """The node hosting ``client`` (the newest of its partition), None if none is connected."""
        if self.num_partitions is None:
            return None
        part = client % self.num_partitions
        best = [(seq, n) for n, (p, _, seq) in self.nodes.items() if p == part]
        return max(best)[1] if best else None

    # ------------------------------------------------------------------ rounds

    def _send(self, kind: str, per_node: Mapping[int, list[int]], plan: dict[str, Any],
              global_state: Mapping[str, Tensor], control: Mapping[str, Tensor] | None,
              group: str) -> tuple[dict[int, Message], int, int]:
        model = ArrayRecord(torch_state_dict=dict(global_state))
        ctl = ArrayRecord(torch_state_dict=dict(control)) if control else None
        msgs: list[Message] = []
        down = 0
        for node, clients in per_node.items():
            content = RecordDict({P.PLAN: ConfigRecord({**plan, P.CLIENTS: list(clients)}), P.GLOBAL: model})
            if ctl is not None:
                content[P.CONTROL] = ctl
            msg = Message(content, dst_node_id=node, message_type=kind, group_id=group)
            down += message_nbytes(msg)
            msgs.append(msg)
        replies: dict[int, Message] = {}
        up = 0
        if msgs:
            for rep in self.exchange(msgs):
                replies[int(rep.metadata.src_node_id)] = rep
                up += message_nbytes(rep)
        return replies, down, up

    def train(self, round_idx: int, clients: Sequence[int], global_state: Mapping[str, Tensor],
              lr_scale: float, control: Mapping[str, Tensor] | None,
              ) -> tuple[list[dict[str, Any]], list[bytes | memoryview], int, int]:
        """One round's training: every selected client's status and payload (a failed one for
        each client whose node is missing, silent or in error), and the bytes down and up."""
        self.refresh()
        per_node: dict[int, list[int]] = {}
        statuses: list[dict[str, Any]] = []
        payloads: list[bytes | memoryview] = []

        def failed(c: int, why: str) -> None:
            statuses.append({"client": c, "ok": False, "n": 0, "loss": None, "headers": [], "nbytes": 0,
                             "error": why})
            payloads.append(b"")

        for c in clients:
            node = self.owner(c)
            if node is None:
                failed(c, f"no connected SuperNode hosts {client_name(c)}")
            else:
                per_node.setdefault(node, []).append(c)
        plan = {P.JOB: self.job_json, P.ROUND: int(round_idx), P.LR_SCALE: float(lr_scale)}
        replies, down, up = self._send("train", per_node, plan, global_state, control, f"train-{round_idx}")
        for node, mine in per_node.items():
            rep = replies.get(node)
            if rep is None:
                for c in mine:
                    failed(c, f"SuperNode {node} did not reply within round_timeout "
                              f"{self.opts.round_timeout:g} s")
                continue
            if rep.has_error():
                for c in mine:
                    failed(c, f"SuperNode {node}: {rep.error.reason}")
                continue
            rec: Any = rep.content.config_records[P.RESULT]
            got = json.loads(str(rec[P.STATUSES]))
            data = memoryview(bytes(rec[P.PAYLOAD]))
            pos = 0
            for st in got:
                nb = int(st.get("nbytes", 0))
                statuses.append(st)
                payloads.append(data[pos : pos + nb])
                pos += nb
        return statuses, payloads, down, up

    def evaluate(self, tag: str, clients: Sequence[int], global_state: Mapping[str, Tensor],
                 ) -> tuple[dict[int, dict[str, float]], int, int]:
        """Each connected client's evaluation sums on its own test split (its node scores it)."""
        self.refresh()
        per_node: dict[int, list[int]] = {}
        for c in clients:
            node = self.owner(c)
            if node is not None:
                per_node.setdefault(node, []).append(c)
        replies, down, up = self._send("evaluate", per_node, {P.JOB: self.job_json}, global_state, None,
                                       f"evaluate-{tag}")
        sums: dict[int, dict[str, float]] = {}
        for rep in replies.values():
            if rep.has_error():
                log.warning("evaluation on SuperNode %d failed: %s", rep.metadata.src_node_id, rep.error.reason)
                continue
            rec: Any = rep.content.config_records[P.RESULT]
            sums.update({int(c): s for c, s in json.loads(str(rec[P.SUMS])).items()})
        return dict(sorted(sums.items())), down, up
