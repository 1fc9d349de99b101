"""The names paratrain's ServerApp and ClientApp agree on (record, node_config and
run_config keys) and how the server waits for replies. No Flower import here.

A train message carries ``ConfigRecord "plan"`` {job (JSON), round, clients, lr_scale,
lineage, keep_from, attempt}, ``ArrayRecord "global"`` and with SCAFFOLD ``"control"``; its
reply ``"result"`` {statuses (JSON), payload, clients, partition-id, num-partitions}. An
evaluate reply carries ``sums`` (each hosted client's evaluation sums) instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# node_config (flower-supernode --node-config 'partition-id=0 num-partitions=2')
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
STATE_DIR = "state-dir"  # optional: where the node keeps its clients' state across server restarts

# record names in a message's RecordDict and in context.state
PLAN, GLOBAL, CONTROL, RESULT, STATE = "plan", "global", "control", "result", "paratrain"

# keys of the records
JOB, ROUND, CLIENTS, LR_SCALE, KEYS = "job", "round", "clients", "lr_scale", "keys"
STATUSES, PAYLOAD, SUMS, HOST_STATE = "statuses", "payload", "sums", "host"
LINEAGE, KEEP_FROM, ATTEMPT, RESUMED = "lineage", "keep_from", "attempt", "resumed"  # RESUMED (reply): state from disk

# run_config ([tool.flwr.app.config] of the app, flwr run --run-config 'job="..."')
RUN_JOB, RUN_RESUME, RUN_OVERWRITE, RUN_WORKDIR = "job", "resume", "overwrite", "workdir"


POLL_S = 0.1  # seconds between pulls of the replies, at first (push_and_pull)


def push_and_pull(grid: Any, msgs: list[Any], timeout: float | None,
                  enough: Callable[[list[Any]], bool] = lambda got: False) -> list[Any]:
    """Push ``msgs`` through Flower's ``grid``; pull replies until every message is answered,
    ``enough(one pull's replies)`` or ``timeout`` seconds (None: no limit) passed."""
    pending = {i for i in grid.push_messages(msgs) if i}
    deadline = None if timeout is None else time.monotonic() + timeout
    out: list[Any] = []
    wait = POLL_S
    while pending:
        got = list(grid.pull_messages(list(pending)))
        for m in got:
            pending.discard(m.metadata.reply_to_message_id)
        out.extend(got)
        if not pending or enough(got) or (deadline is not None and time.monotonic() > deadline):
            break
        # POLL_S after a pull that brought something, 1.5x longer per empty pull up to 1 s, not
        # a fixed 0.1 s: every pull is a request the SuperLink serves, and waiting out a round of
        # ClientApp processes (seconds each) that way held the load of six runs on 2 cores near 7
        wait = POLL_S if got else min(wait * 1.5, 1.0)
        time.sleep(wait)
    return out
