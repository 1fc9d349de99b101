"""The names paratrain's ServerApp and ClientApp agree on (record keys, node_config keys,
run_config keys). No Flower import here.

A train message (server -> node): ``ConfigRecord "plan"`` {job (the job as JSON), round,
clients (the selected clients this node hosts), lr_scale, lineage and keep_from (where a node
with a ``state-dir`` keeps its clients' state: :mod:`.node_state`)} and ``ArrayRecord "global"`` (the
server's model, every tensor in its dtype: exact); with SCAFFOLD also ``ArrayRecord
"control"`` (the server's control variate ``c``). Its reply: ``ConfigRecord "result"``
{statuses (JSON: the local path's per-client status, tensor headers included), payload (the
clients' encoded updates, concatenated bytes), clients (those the node answers for: the
selected ones it hosts), partition-id, num-partitions}. An evaluate message carries the plan
(every client; round: the state it scores with is the one entering that round) and the model; its reply ``result`` {sums (JSON: each hosted client's
evaluation sums), clients, partition-id, num-partitions}."""

from __future__ import annotations

import time

__all__ = ["PARTITION_ID", "NUM_PARTITIONS", "PLAN", "GLOBAL", "CONTROL", "RESULT", "STATE",
           "JOB", "ROUND", "CLIENTS", "LR_SCALE", "KEYS", "STATUSES", "PAYLOAD", "SUMS", "HOST_STATE",
           "RUN_JOB", "RUN_RESUME", "RUN_OVERWRITE", "RUN_WORKDIR", "STATE_DIR", "LINEAGE", "KEEP_FROM",
           "RESUMED", "Backoff"]

# node_config (flower-supernode --node-config 'partition-id=0 num-partitions=2')
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
STATE_DIR = "state-dir"  # optional: where the node keeps its clients' state across server restarts

# record names in a message's RecordDict and in context.state
PLAN, GLOBAL, CONTROL, RESULT, STATE = "plan", "global", "control", "result", "paratrain"

# keys of the records
JOB, ROUND, CLIENTS, LR_SCALE, KEYS = "job", "round", "clients", "lr_scale", "keys"
STATUSES, PAYLOAD, SUMS, HOST_STATE = "statuses", "payload", "sums", "host"
LINEAGE, KEEP_FROM, RESUMED = "lineage", "keep_from", "resumed"  # RESUMED (reply): state from disk

# run_config ([tool.flwr.app.config] of the app, flwr run --run-config 'job="..."')
RUN_JOB, RUN_RESUME, RUN_OVERWRITE, RUN_WORKDIR = "job", "resume", "overwrite", "workdir"


class Backoff:
    """The wait between two pulls of a message's replies: ``first`` seconds after a pull
    that brought something (the others are likely near), growing 1.5x per empty pull up to
    ``most``. Why not a fixed 0.1 s: every pull is a request the SuperLink serves, and a
    ServerApp waiting out a round of ClientApp processes (seconds each: one process per
    message, importing torch) spent the machine's CPU asking; measured on 2 cores, six runs
    at once on one federation held the load near 7. (Flower's own ``send_and_receive``
    waits 3 s between pulls.)"""

    def __init__(self, first: float = 0.1, most: float = 1.0) -> None:
        self.first, self.most, self.wait = first, most, first

    def sleep(self, got: bool) -> None:
        self.wait = self.first if got else min(self.wait * 1.5, self.most)
        time.sleep(self.wait)
