"""Beyond one machine: two "hosts" (network namespaces joined by a veth pair, each with
its own address and its own run folder) train a DataParallel and a Pipeline job with
``paratrain run --nnodes 2`` and with ``torchrun --nnodes 2``, to the parameters of the
same job on one machine; killing every process of one host mid-run and starting that
host's command again (``--resume``) ends with bit-identical parameters.

Nothing is shared between the hosts but the network: each host has its own job file,
plugin file and ``run.output_dir`` (checkpoints of its ranks stay on its own disk, as on
separate machines). Skips, saying why, where namespaces cannot be made (needs root and
iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import _netns

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

_netns.skip_without("test_two_hosts")

BIN = Path(sys.executable).parent
TIMEOUT = 300

# The model of both jobs, a plugin each host imports (run.imports). With PT_PAUSE_AT=RANK:N
# the process of global rank RANK stops itself (SIGSTOP) at the N-th training forward of
# `head` and writes PT_PAUSED, so the test can kill its whole host at a known point. With
# PT_CALLS set, the process writes there how many training forwards of `head` it ran
# (a host that resumed runs only the steps after the checkpoint).
PLUGIN = '''
import math, os, signal, time
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

_calls = [0]


def _pause(module, args):
    if not module.training or not torch.is_grad_enabled():
        return
    _calls[0] += 1
    if os.environ.get("PT_CALLS"):
        Path(os.environ["PT_CALLS"]).write_text(str(_calls[0]))
    rank, _, call = os.environ.get("PT_PAUSE_AT", "").partition(":")
    if os.environ.get("RANK") == rank and _calls[0] == int(call):
        # checkpoints are written by a thread while training goes on: the stop comes once
        # this host's step-8 checkpoint has landed (the kill is *between* checkpoints)
        runs = Path(os.environ["PT_RUNS"])
        for _ in range(1200):
            if any(runs.rglob("step-000000008/layout.json")):
                break
            time.sleep(0.05)
        Path(os.environ["PT_PAUSED"]).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)


def build(input_shape, num_classes, hidden=16):
    model = nn.Sequential(OrderedDict(
        flatten=nn.Flatten(), fc0=nn.Linear(math.prod(input_shape), hidden), act0=nn.ReLU(),
        head=nn.Linear(hidden, num_classes)))
    model.head.register_forward_pre_hook(_pause)
    return model
'''

COMMON = """
[run]
name = "{name}"
seed = 3
output_dir = "{out}"
checkpoint_every = 4
max_restarts = 1
imports = ["hostmodel.py"]

[model]
factory = "hostmodel:build"

[train]
epochs = 1
batch_size = 16
max_steps = 20
"""

STRATEGY = {
    "dp": """
[strategy]
type = "DataParallel"
num_replicas = 2
aggregation = { method = "AllReduce" }
""",
    "pipe": """
[strategy]
type = "ModelParallel"
communication = { protocol = "Pipeline", micro_batch_size = 8, schedule = "1F1B" }

[[strategy.partitions]]
node_ids = ["head"]
target = { WorkerId = "w1" }

[[workers]]
id = "w0"

[[workers]]
id = "w1"
""",
}
# The rank-1 forward of `head` to stop at: after the step-8 checkpoint, before step 12's
# (DataParallel: one forward a step; the pipeline: two micro-batches a step).
PAUSE_CALL = {"dp": 10, "pipe": 19}


Pair = tuple[_netns.Host, _netns.Host]


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, Pair]]:
    """Two pairs of hosts: ``killed`` (whose host b the test kills) and ``whole`` (an
    uninterrupted run beside it, on machines of its own). Removed, with every process in
    them, even when a test fails."""
    _netns.remove_stale()  # left by a session killed before its finalizer ran
    pid = os.getpid()
    made: list[_netns.Host] = []
    try:
        pairs: dict[str, Pair] = {}
        for i, role in enumerate(("killed", "whole")):
            pairs[role] = _netns.make_hosts(f"{pid}{'kw'[i]}", subnet=2 * pid + i)
            made += pairs[role]
        yield pairs
    finally:
        _netns.remove_hosts(*made)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
           and not k.startswith(("PARATRAIN_", "TORCHELASTIC_", "PT_", "GLOO_"))}
    return env | {"OMP_NUM_THREADS": "1", **extra}


def _machine(root: Path, kind: str, name: str) -> Path:
    """A folder standing for one machine's disk: the job file, the plugin, its runs."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "hostmodel.py").write_text(PLUGIN)
    (root / "job.toml").write_text(COMMON.format(name=name, out=root / "runs") + STRATEGY[kind])
    return root / "job.toml"


def _command(launcher: str, job: Path, host: _netns.Host, rank: int, endpoint: str, *,
             resume: bool = False) -> list[str]:
    """This host's command of a 2-node launch (``rank`` 0 hosts the rendezvous):
    ``paratrain`` with --node-rank (torch's static rendezvous), ``paratrain-c10d`` without
    (c10d, node ranks assigned at the rendezvous), or ``torchrun``."""
    again = ["--resume"] if resume else []
    if launcher.startswith("paratrain"):
        fixed = ["--node-rank", str(rank)] if launcher == "paratrain" else []
        return [str(BIN / "paratrain"), "run", str(job), "--quiet", "--nnodes", "2", *fixed,
                "--rdzv-endpoint", endpoint, *again]
    # The namespaces' host name resolves to 127.0.0.1 (one /etc/hosts): torchrun is told
    # this machine's address (--local-addr: what peers connect to) and which machine hosts
    # the rendezvous (is_host), as on machines whose names do not resolve to them.
    return [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, *(["--rdzv-conf", "is_host=1"] if rank == 0 else []),
            "--local-addr", host.addr, "--max-restarts", "1", "-m", "paratrain.worker", str(job), *again]


def _start(argv: list[str], host: _netns.Host | None, log: Path, **env: str) -> subprocess.Popen[bytes]:
    cmd = host.cmd(argv) if host is not None else argv
    if argv[0].endswith("torchrun"):
        # torch's c10d rendezvous shares one TCPStore across rounds by default, and its
        # node-0 agent then never tells a node that joins a later round (a replaced
        # machine) where that store is: the new node waits for MASTER_ADDR until it times
        # out. With a store per round, rank 0 of each round publishes it.
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    with log.open("wb") as f:
        return subprocess.Popen(cmd, cwd=log.parent, env=_env(**env), stdout=f, stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _summary(*jobs: Path) -> dict[str, Any]:
    """The summary rank 0 wrote, on whichever of these machines it ran (a c10d rendezvous
    assigns node ranks itself); the others hold none."""
    found = [f for job in jobs for f in (job.parent / "runs").rglob("summary.json")]
    assert len(found) == 1, found
    data: dict[str, Any] = json.loads(found[0].read_text())
    return data


def _wait_for(path: Path, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        for k, p in procs.items():
            assert p.poll() is None, f"{k} exited {p.returncode} before the pause:\n{logs[k].read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no rank paused"
        time.sleep(0.05)


# Per job: the launcher of the uninterrupted 2-host run, and that of the run whose host b
# is killed and restarted (both launchers see both jobs, and both see a host killed).
LAUNCHERS = {"dp": ("torchrun", "paratrain"), "pipe": ("paratrain-c10d", "torchrun")}


@pytest.mark.parametrize("kind", ["dp", "pipe"])
def test_two_hosts_train_the_one_machine_parameters_also_after_losing_a_host(
    hosts: dict[str, Pair], tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """At once: the job on one machine; on two hosts under one launcher; and on two other
    hosts under the other launcher, where host b (node rank 1) stops mid-step after the
    step-8 checkpoint and every process on it is SIGKILLed (the machine going down). Host
    a's launcher restarts its worker (max_restarts 1) and waits; host b's command, run
    again with --resume, rejoins. All three end with the same parameters."""
    launcher = dict(zip(("whole", "killed"), LAUNCHERS[kind], strict=True))
    port = {"dp": 29510, "pipe": 29520}[kind]
    single = _machine(tmp_path / "single", kind, "single")
    jobs = {(r, h.ns): _machine(tmp_path / r / h.ns[-1], kind, r) for r in hosts for h in hosts[r]}
    argv = {"single": ([str(BIN / "paratrain"), "run", str(single), "--quiet"], None)}
    for run, pair in hosts.items():
        for rank, h in enumerate(pair):
            argv[f"{run}-{h.ns[-1]}"] = (
                _command(launcher[run], jobs[run, h.ns], h, rank, f"{pair[0].addr}:{port}"), h)
    a, b = hosts["killed"]
    logs = {k: tmp_path / f"{k}.log" for k in [*argv, "killed-b-again"]}
    paused, calls = tmp_path / "paused", tmp_path / "calls"
    pause = {"PT_PAUSE_AT": f"1:{PAUSE_CALL[kind]}", "PT_PAUSED": str(paused),
             "PT_RUNS": str(jobs["killed", b.ns].parent / "runs")}
    started = time.monotonic()
    procs = {k: _start(cmd, host, logs[k], **(pause if k == "killed-b" else {}))
             for k, (cmd, host) in argv.items()}
    try:
        _wait_for(paused, {k: procs[k] for k in ("killed-a", "killed-b")}, logs)
        lost = b.kill_all()  # every process of host b
        assert len(lost) >= 2, lost  # the launcher (agent) and the worker at least
        assert not b.pids()
        ckpts = sorted(p.name for p in (jobs["killed", b.ns].parent / "runs").rglob("step-*")
                       if (p / "layout.json").is_file())
        assert ckpts and ckpts[-1] == "step-000000008", ckpts  # killed between checkpoints
        killed_at = time.monotonic()
        procs.pop("killed-b").wait(timeout=30)
        again = _command(launcher["killed"], jobs["killed", b.ns], b, 1, f"{a.addr}:{port}", resume=True)
        procs["killed-b-again"] = _start(again, b, logs["killed-b-again"], PT_CALLS=str(calls))
        deadline, ended = time.monotonic() + TIMEOUT, {}
        while len(ended) < len(procs) and time.monotonic() < deadline:
            ended |= {k: time.monotonic() - killed_at for k, p in procs.items()
                      if k not in ended and p.poll() is not None}
            time.sleep(0.1)
    finally:
        _stop(list(procs.values()))
    codes = {k: p.returncode for k, p in procs.items()}
    assert all(c == 0 for c in codes.values()), (
        codes, {k: logs[k].read_text(errors="replace")[-3000:] for k in procs})
    wall, after_kill = time.monotonic() - started, time.monotonic() - killed_at
    one, two = _summary(single), _summary(*(jobs["whole", h.ns] for h in hosts["whole"]))
    again_ = _summary(jobs["killed", a.ns], jobs["killed", b.ns])
    assert one["steps"] == two["steps"] == again_["steps"] == 20
    assert one["parameters_sha256"] == two["parameters_sha256"] == again_["parameters_sha256"]
    # The restarted host trained steps 9..20 only (one forward of `head` a step, or one a
    # micro-batch): it resumed from the step-8 checkpoint on its own disk.
    assert int(calls.read_text()) == 12 * (1 if kind == "dp" else 2)
    if "resumed_from_step" in again_:
        assert again_["resumed_from_step"] == 8
    if launcher["killed"] == "paratrain":
        assert "restarted from step 8" in logs["killed-a"].read_text()
    # Each host kept its own rank's checkpoints on its own disk.
    # (a DCP folder per host: its own .metadata, and only its own rank's data file)
    for r in ("whole", "killed"):
        held = sorted(p.name for h in hosts[r]
                      for p in (jobs[r, h.ns].parent / "runs").rglob("step-000000020/__*_0.distcp"))
        assert held == ["__0_0.distcp", "__1_0.distcp"], held
        assert all(list((jobs[r, h.ns].parent / "runs").rglob("step-000000020/.metadata"))
                   for h in hosts[r])
    with capsys.disabled():
        print(f"\n[two hosts] {kind}: one machine, {launcher['whole']} on 2 hosts, {launcher['killed']} "
              f"on 2 hosts with host b "
              f"killed after step 8 and restarted, all at once: {wall:.1f} s ({after_kill:.1f} s after "
              f"the kill); parameters_sha256 {one['parameters_sha256']} for all three; "
              f"exits after the kill: { {k: round(v, 1) for k, v in ended.items()} }")
