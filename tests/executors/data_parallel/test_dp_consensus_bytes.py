"""Decentralized gossip measures consensus with an all-gather of every parameter each step;
that traffic is counted in the aggregator's counter (and so in comm_bytes_per_step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm import collectives as C
from paratrain.comm.testing import run_distributed
from paratrain.executors.data_parallel.aggregation import DecentralizedAgg


def _rank(ctx: Any) -> dict[str, Any]:
    torch.manual_seed(ctx.rank)  # replicas differ, so the distance is not zero
    model = nn.Linear(5, 3)
    counter = C.CommCounter()
    agg = DecentralizedAgg(model, group=ctx.group, counter=counter, topology="ring")
    extra = agg.after_step()
    agg.close()
    return {"bytes": dict(counter.bytes), "total": counter.total_bytes,
            "distance": extra["consensus_distance"]}


@pytest.mark.slow
def test_consensus_all_gather_is_counted() -> None:
    res = run_distributed(_rank, 2, timeout_s=120)
    param_bytes = (5 * 3 + 3) * 4
    for r in res:
        assert r["bytes"]["consensus_all_gather"] == param_bytes
        # gossip (the step's own exchange) and the consensus probe both count
        assert r["total"] == sum(r["bytes"].values()) > param_bytes
        assert r["distance"] >= 0.0
