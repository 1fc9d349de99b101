"""paratrain.comm.rendezvous: a group that forms on a store an earlier group used, with ranks
whose restart counts differ (a replaced machine counts from 0 while the survivor is at 1),
still meets; gloo keeps its default interface unless it would be loopback for peers on
other machines. (Across real network namespaces: tests/comm/test_two_hosts.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from paratrain.comm.rendezvous import gloo_interface, group_prefix
from paratrain.comm.testing import free_port

pytestmark = pytest.mark.timeout(300)

# One worker: join the default group the way every paratrain worker does (the agent's
# store, as under the elastic launcher), all-reduce its rank + 1, print the sum, and end as
# `python -m paratrain.worker` does (exit_process: no interpreter finalization, where gloo's
# threads could abort a finished process).
WORKER = """
import torch, torch.distributed as dist
from paratrain.comm.process import exit_process, join_process_group, leave_process_group
from paratrain.config import load_job
ctx = join_process_group(load_job({"comm": {"timeout_s": 20}}))
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
leave_process_group()
exit_process(0)
"""


def _group(port: int, restart_counts: list[int]) -> list[subprocess.CompletedProcess[str]]:
    procs = []
    for rank, count in enumerate(restart_counts):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PARATRAIN_", "TORCHELASTIC_"))}
        env |= {"RANK": str(rank), "WORLD_SIZE": str(len(restart_counts)), "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(count)}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


def test_a_replaced_node_and_a_restarted_one_meet_on_a_used_store() -> None:
    """The agent's store outlives its groups. The first group (attempt 0 everywhere) leaves
    its keys behind; then rank 0 comes back as attempt 1 (its agent restarted it) and rank
    1 as attempt 0 (a new machine's agent). With a key prefix per attempt they would
    never meet (rank 1 reads the dead group's gloo addresses, rank 0 waits under another
    prefix until the timeout); agreeing on a fresh prefix they do."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=60))
    for counts in ([0, 0], [1, 0]):
        done = _group(port, counts)
        assert [c.returncode for c in done] == [0, 0], [c.stdout[-2000:] for c in done]
        assert all("sum 3" in c.stdout for c in done), [c.stdout[-2000:] for c in done]
    del agent_store


def test_group_prefix_is_new_for_every_group_and_one_rank_alone_needs_no_peer() -> None:
    store = dist.HashStore()
    first = group_prefix(store, rank=0, world_size=1, timeout=timedelta(seconds=5))
    second = group_prefix(store, rank=0, world_size=1, timeout=timedelta(seconds=5))
    assert first != second and first.startswith("paratrain/group/")


def test_gloo_keeps_its_default_unless_peers_would_be_sent_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_interface("127.0.0.1", 29500) is None  # one machine: loopback is right
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert gloo_interface("192.0.2.1", 29500) is None  # the user's choice wins
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = "127.0.0.1"
    if not own.startswith("127."):
        # this machine's name resolves to a real address: gloo's default already works
        assert gloo_interface("192.0.2.1", 29500) is None
    elif Path("/proc/net/route").exists():
        # the name resolves to loopback: the interface that routes to the master instead
        # (None when no route leads to the TEST-NET address at all)
        assert gloo_interface("192.0.2.1", 29500) != "lo"


def test_the_rendezvous_machine_is_found_by_route_where_the_host_name_is_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``paratrain run --nnodes 2 --rdzv-endpoint HOST:PORT`` (c10d, no --node-rank): where
    this machine's name resolves to loopback, torch took the endpoint for another machine
    on every node and nobody hosted the store; the endpoint's machine now hosts it and
    every node tells its peers the address on the route to it."""
    from paratrain.comm.rendezvous import address_towards, launch_config, rendezvous_host
    from paratrain.config import load_job

    assert rendezvous_host("127.0.0.1", 29500) == (None, None)  # one box: torch's own rule
    own = address_towards("192.0.2.1", 9)  # this machine's address on its default route
    if own is None or own.startswith("127.") or not socket.gethostbyname(socket.gethostname()).startswith("127."):
        pytest.skip("needs a non-loopback address and a host name resolving to loopback")
    assert rendezvous_host(own, 29500) == (own, True)
    assert rendezvous_host("192.0.2.1", 29500) == (own, None)  # another machine: torch decides
    for var in ("PARATRAIN_NODE_RANK", "PARATRAIN_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PARATRAIN_NNODES", "2")
    monkeypatch.setenv("PARATRAIN_RDZV_ENDPOINT", f"{own}:29500")
    cfg = launch_config(load_job({"run": {"name": "j"}}), nprocs=2)
    assert (cfg.rdzv_backend, cfg.local_addr, cfg.rdzv_configs.get("is_host")) == ("c10d", own, True)
