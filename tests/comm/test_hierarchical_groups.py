"""Issue 12 item 10: two-level (Hierarchical) groups come from the real topology — ranks
on one host (one torchrun node) form a local group — not from blocks of ceil(sqrt(p))."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paratrain.comm.groups import describe_hierarchy, hierarchy_from_hosts, host_label
from paratrain.config import ConfigError

# ------------------------------------------------------------------ pure functions


def test_hierarchy_from_hosts_examples() -> None:
    assert hierarchy_from_hosts([]) == []
    assert hierarchy_from_hosts(["a"]) == [[0]]
    assert hierarchy_from_hosts(["a"] * 4) == [[0, 1, 2, 3]]  # flat: one host, one group
    assert hierarchy_from_hosts(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert hierarchy_from_hosts(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]  # not blocks
    assert hierarchy_from_hosts(["b", "a", "a", "c", "b"]) == [[0, 4], [1, 2], [3]]
    # 5 ranks on 2 hosts: sqrt blocks would say [[0,1,2],[3,4]]
    assert hierarchy_from_hosts(["h0"] * 4 + ["h1"]) == [[0, 1, 2, 3], [4]]


@given(st.lists(st.sampled_from("abcd"), min_size=0, max_size=24))
def test_hierarchy_from_hosts_partitions_by_label(hosts: list[str]) -> None:
    groups = hierarchy_from_hosts(hosts)
    assert sorted(r for g in groups for r in g) == list(range(len(hosts)))
    assert len(groups) == len(set(hosts))
    for g in groups:
        assert g == sorted(g) and len({hosts[r] for r in g}) == 1
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_host_label_from_env() -> None:
    assert host_label(3, env={}, hostname="h") == "h"
    assert host_label(3, env={"LOCAL_WORLD_SIZE": "2"}, hostname="h") == "h/node1"
    assert host_label(3, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "7"}, hostname="h") == "h/node7"
    for bad in ("two", "0"):
        with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE: must be a positive integer"):
            host_label(0, env={"LOCAL_WORLD_SIZE": bad}, hostname="h")


def test_describe_hierarchy() -> None:
    assert describe_hierarchy([[0, 1, 2, 3]], ["h"] * 4) == "flat (1 host)"
    labels = ["h/node0", "h/node0", "h/node1", "h/node1"]
    assert describe_hierarchy([[0, 1], [2, 3]], labels) == "2 local groups of 2 (1 host)"
    assert describe_hierarchy([[0, 1, 2], [3]], ["a"] * 3 + ["b"]) == "2 local groups of sizes 1, 3 (2 hosts)"


# ------------------------------------------------------------------ real process groups

LAYOUTS: dict[str, dict[str, str] | None] = {
    "flat": None,  # one host, no LOCAL_WORLD_SIZE
    "lws2": {"LOCAL_WORLD_SIZE": "2"},  # two torchrun nodes of 2 (rank // 2)
    "interleaved": {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "rank%2"},  # nodes {0,2}, {1,3}
}


def hier_worker(ctx: Any) -> dict[str, Any]:
    import os
    from collections import OrderedDict

    from torch import nn

    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.config import TensorParallelismConfig
    from paratrain.tensor_parallel import parallelize

    out: dict[str, Any] = {}
    for name, env in LAYOUTS.items():
        for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
            os.environ.pop(k, None)
        for k, v in (env or {}).items():
            os.environ[k] = str(ctx.rank % 2) if v == "rank%2" else v
        groups = build_tp_groups(ctx.world_size, pattern="Hierarchical")
        comm = groups.tp
        h = comm._hier
        assert h is not None
        comm.stats.reset()
        total = comm.all_reduce(torch.tensor([float(ctx.rank + 1)], dtype=torch.float64))
        torch.manual_seed(0)
        model = nn.Sequential(OrderedDict(fc0=nn.Linear(4, 8), act=nn.ReLU(), fc1=nn.Linear(8, 2)))
        tpm = parallelize(model, TensorParallelismConfig(
            tensor_parallel_size=ctx.world_size, communication_pattern="Hierarchical",
            memory_optimization="None"), groups)
        out[name] = {
            "local": list(h.intra_ranks), "leader": h.leader, "hierarchy": comm.hierarchy,
            "sum": float(total.item()), "calls": dict(comm.stats.counts),
            "stats_hierarchy": tpm.statistics()["hierarchy"],
        }
    return out


@pytest.mark.slow
def test_hierarchical_groups_follow_the_topology_on_4_ranks() -> None:
    from paratrain.comm.testing import run_distributed

    res = run_distributed(hier_worker, 4, timeout_s=240)
    for rank, r in enumerate(res):
        for name in LAYOUTS:
            assert r[name]["sum"] == 10.0, (rank, name, r[name])  # 1 + 2 + 3 + 4
            assert r[name]["stats_hierarchy"] == r[name]["hierarchy"]
        # flat: one host -> one local group of all 4; reduce + broadcast, no leaders' all-reduce
        assert r["flat"]["local"] == [0, 1, 2, 3] and r["flat"]["leader"] == 0
        assert r["flat"]["hierarchy"] == "flat (1 host)"
        assert "all_reduce" not in r["flat"]["calls"]
        # LOCAL_WORLD_SIZE = 2: nodes {0, 1} and {2, 3}
        assert r["lws2"]["local"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["lws2"]["hierarchy"] == "2 local groups of 2 (1 host)"
        # GROUP_RANK decides the node: {0, 2} and {1, 3} (sqrt blocks would say {0, 1}, {2, 3})
        assert r["interleaved"]["local"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert r["interleaved"]["leader"] == rank % 2
    # only leaders talk across nodes
    assert res[0]["lws2"]["calls"].get("all_reduce") == 1
    assert "all_reduce" not in res[1]["lws2"]["calls"]
    assert res[1]["interleaved"]["calls"].get("all_reduce") == 1
    assert "all_reduce" not in res[2]["interleaved"]["calls"]
