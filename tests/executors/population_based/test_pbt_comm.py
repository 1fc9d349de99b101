"""JSON control-plane collectives of PBT on real gloo ranks (no pickle on the wire)."""

from __future__ import annotations

import pytest

from _workers_pbt import json_ops_worker
from paratrain.comm.collectives import broadcast_json, gather_json
from paratrain.comm.testing import run_distributed


def test_single_process_passthrough() -> None:
    assert gather_json({"a": 1}, group=None) == [{"a": 1}]
    assert broadcast_json([1, 2], group=None) == [1, 2]


@pytest.mark.slow
def test_gather_and_broadcast_on_two_ranks() -> None:
    out = run_distributed(json_ops_worker, 2, timeout_s=120)
    g0 = out[0]["gathered"]
    assert [d["rank"] for d in g0] == [0, 1]
    assert [len(d["payload"]) for d in g0] == [10, 1010]  # uneven sizes, padded
    assert g0[0]["f"] == [0.5, None]
    assert out[1]["gathered"] is None
    for r in out:
        assert r["plan"] == {"from": 0, "nested": {"a": [1, 2.5, "s"]}}
        assert r["empty"] == ""
    # The oversize payload is refused by every rank, before allocating for it.
    assert all(r["too_big"] and "outside [0, 1000]" in r["too_big"] for r in out)
