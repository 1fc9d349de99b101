"""comm: collectives on real gloo ranks, bucketing, topologies, targets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _workers_dp import comm_checks
from paratrain.comm.buckets import make_buckets
from paratrain.comm.context import WorkerInfo, resolve_rank, resolve_target, workers_with_tags
from paratrain.comm.groups import TOPOLOGIES, grid_shape, mixing_weights, neighbors
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError
from paratrain.executors.data_parallel.aggregation import pack_records, unpack_records

pytestmark = pytest.mark.timeout(200)


@pytest.mark.slow
def test_collectives_on_two_ranks() -> None:
    res = run_distributed(comm_checks, 2, timeout_s=120,
                          workers=[_Spec("ps", ["server"]), _Spec("w1", [])])
    n = 2
    inputs = [[torch.tensor(t, dtype=torch.float64) for t in r["inputs"]] for r in res]
    mean = [sum(rank[i] for rank in inputs) / n for i in range(len(inputs[0]))]
    for r in res:
        for got_s, got_b, want in zip(r["reduced_small"], r["reduced_big"], mean, strict=True):
            torch.testing.assert_close(torch.tensor(got_s, dtype=torch.float64), want, rtol=1e-6, atol=1e-6)
            assert got_s == got_b  # bucket size changes grouping, not the result
        assert r["small_calls"] >= 4  # 64-byte buckets: several collectives (non-vacuity)
        assert r["reducer_ok"]
        assert r["unused_ok"] and r["used_grad"] == [[1.5] * 3, [1.5] * 3]  # mean of inputs 1 and 2
        assert r["gathered"] == [[0], [1, 2, 3, 4]]
        assert r["rs_native"] == r["rs_fallback"]
        assert r["ag_native"] == r["ag_fallback"] == [0.0, 0.5, 1.0, 1.5]
        assert r["bcast"] == [[0.0] * 3, [[1.0, 1.0], [1.0, 1.0]]]
    flat_sum = [sum(k * (rank + 1) for rank in range(n)) for k in range(4 * n)]
    assert res[0]["rs_native"] == flat_sum[0:4] and res[1]["rs_native"] == flat_sum[4:8]
    # uneven chunks, averaged: chunk i on rank r holds r + 1 + i
    assert res[0]["rs_uneven"] == [1.5 + 0] * 2 and res[1]["rs_uneven"] == [2.5] * 3
    assert res[0]["p2p"] == "hello from 1" and res[1]["p2p"] == "hello from 0"
    assert res[0]["p2p_raw"] == "raw 1" and res[1]["p2p_raw"] == "raw 0"
    assert res[0]["exchanged"] == {1: "xx"} and res[1]["exchanged"] == {0: "x"}
    assert res[0]["used"] == res[1]["used"] == [True, True, False]
    assert [r["worker_id"] for r in res] == ["ps", "w1"]


class _Spec:
    def __init__(self, id: str, tags: list[str]) -> None:
        self.id, self.tags = id, tags


@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([torch.float32, torch.float64])),
                max_size=25), st.integers(1, 200))
def test_make_buckets_partition(specs: list[tuple[int, torch.dtype]], cap: int) -> None:
    ts = [torch.zeros(k, dtype=dt) for k, dt in specs]
    buckets = make_buckets(ts, cap)
    assert [i for b in buckets for i in b] == list(range(len(ts)))  # each once, in order
    for b in buckets:
        assert len({ts[i].dtype for i in b}) == 1
        # closed once full: without its last tensor a bucket held less than the cap
        assert sum(ts[i].numel() * ts[i].element_size() for i in b[:-1]) < cap


@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.integers(1, 800),
       st.one_of(st.none(), st.integers(1, 400)))
def test_make_buckets_equals_ddps_assignment(numels: list[int], cap: int, first: int | None) -> None:
    """The buckets torch DDP's reducer builds from the same tensors and limits (its
    ``compute_bucket_assignment_by_size``: the first limit for the first bucket, the cap after)."""
    ts = [torch.zeros(n) for n in numels]
    limits = [cap] if first is None else [first, cap]
    ddp, _ = torch.distributed._compute_bucket_assignment_by_size(ts, limits, [False] * len(ts))
    assert make_buckets(ts, cap, first_bucket_bytes=first) == [list(b) for b in ddp]


@given(st.integers(1, 24), st.sampled_from(TOPOLOGIES))
def test_topologies_doubly_stochastic_and_contracting(n: int, topo: str) -> None:
    nb = neighbors(topo, n)
    for i, js in enumerate(nb):
        assert i not in js and all(i in nb[j] for j in js)  # symmetric, no self loops
    w = mixing_weights(topo, n)
    torch.testing.assert_close(w, w.T)
    torch.testing.assert_close(w.sum(0), torch.ones(n, dtype=torch.float64))
    assert float(w.min()) >= 0.0
    if n > 1:
        # Connected graph: every eigenvalue but the one for the mean has |lambda| < 1,
        # so repeated gossip converges to the average (consensus distance -> 0).
        ev = torch.linalg.eigvalsh(w).abs().sort().values
        assert float(ev[-2]) < 1.0 - 1e-9
    if topo == "complete":
        torch.testing.assert_close(w, torch.full((n, n), 1.0 / n, dtype=torch.float64))


def test_torus_grid_and_unknown_topology() -> None:
    assert grid_shape(12) == (3, 4) and grid_shape(7) == (1, 7) and grid_shape(16) == (4, 4)
    assert neighbors("torus", 16)[5] == [1, 4, 6, 9]
    with pytest.raises(ConfigError, match="ring, torus, complete"):
        neighbors("star", 4)


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_record_framing_roundtrip_and_truncation(records: list[bytes]) -> None:
    blob = pack_records(records).numpy().tobytes()
    assert unpack_records(blob, len(records)) == records
    if blob:
        with pytest.raises(ValueError):
            unpack_records(blob[:-1], len(records))
    with pytest.raises(ValueError):
        unpack_records(blob + b"x", len(records))


def test_resolve_targets() -> None:
    ws = [WorkerInfo(0, "worker-0"), WorkerInfo(1, "gpu-box", ("gpu", "big")), WorkerInfo(2, "w2", ("gpu",))]
    assert resolve_rank({"WorkerId": "gpu-box"}, ws) == 1
    assert resolve_target({"Tag": "gpu"}, ws).id == "gpu-box"  # first by rank
    assert [w.rank for w in workers_with_tags(ws, ["gpu"])] == [1, 2]
    with pytest.raises(ConfigError, match="registered ids: worker-0, gpu-box, w2"):
        resolve_target({"WorkerId": "nope"}, ws, field="strategy.partitions[0].target")
    with pytest.raises(ConfigError, match="registered tags: big, gpu"):
        resolve_target({"Tag": "tpu"}, ws)
