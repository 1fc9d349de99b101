"""Fault tolerance across two "hosts" (network namespaces joined by a veth pair, each with
its own address and run folder, as tests/comm/test_two_hosts.py): host a runs ``paratrain
run`` with the Lighthouse (``listen`` on its veth address) and replica group 0, host b runs
group 1 with ``paratrain run --join-group 1`` against host a's Lighthouse. Once both groups
trained steps together, host b's link is cut (its veth set down): host a's group goes on
alone without a restart (``min_replicas = 1``) and finishes the run, its metrics and
``replica-0.json`` show the steps it took alone; host b's command ends with a clear error,
not a hang. Skips, saying why, where namespaces cannot be made (needs root and iproute2).
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

pytestmark = [pytest.mark.timeout(300)]

_netns.skip_without("test_fault_tolerance_two_hosts")

BIN = Path(sys.executable).parent
PORT = 29610
STEPS = 3000

JOB = """
[run]
name = "ft2"
seed = 3
output_dir = "{out}"
log_every = 10
progress_every = "off"
max_restarts = 0

[model]
name = "mlp"
hidden = [32]

[data]
name = "digits"

[train]
epochs = 1000
batch_size = 16
max_steps = {steps}
eval_every = 0

[comm]
timeout_s = 10

[strategy]
type = "DataParallel"
num_replicas = 2
aggregation = {{ method = "AllReduce" }}

[fault_tolerance]
min_replicas = 1
quorum_timeout_s = 10
join_timeout_s = 0.5
heartbeat_timeout_s = 2
groups = 1
{lighthouse}
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[_netns.Host, _netns.Host]]:
    _netns.remove_stale()  # left by a session killed before its finalizer ran
    pair = _netns.make_hosts(f"{os.getpid()}f", subnet=2 * os.getpid() + 7)
    try:
        yield pair
    finally:
        _netns.remove_hosts(*pair)


def _records(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines[:-1] if line.strip()]  # the last may be half written


def _wait(what: str, ok: Any, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path],
          timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for k, p in procs.items():
            assert p.poll() is None, f"{k} exited {p.returncode} before {what}:\n{logs[k].read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)  # polling the runs' own output


def test_link_cut_host_drops_out_and_the_other_finishes_alone(
        hosts: tuple[_netns.Host, _netns.Host], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = hosts
    tables = {"a": f'lighthouse = "start"\nlisten = "{a.addr}:{PORT}"', "b": f'lighthouse = "{a.addr}:{PORT}"'}
    jobs, logs, procs = {}, {}, {}
    for h in "ab":  # a folder per machine: its job file and its runs
        (tmp_path / h).mkdir()
        jobs[h] = tmp_path / h / "job.toml"
        jobs[h].write_text(JOB.format(out=tmp_path / h / "runs", steps=STEPS, lighthouse=tables[h]))
        logs[h] = tmp_path / f"{h}.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PARATRAIN_", "GLOO_"))},
           "OMP_NUM_THREADS": "1"}
    argv = {"a": [str(BIN / "paratrain"), "run", str(jobs["a"]), "--quiet"],
            "b": [str(BIN / "paratrain"), "run", str(jobs["b"]), "--join-group", "1"]}
    run_a, metrics = tmp_path / "a" / "runs" / "ft2", tmp_path / "a" / "runs" / "ft2" / "metrics.jsonl"
    started = time.monotonic()
    try:
        for h, host in zip("ab", hosts, strict=True):  # at once: host b's group waits for the Lighthouse
            with logs[h].open("wb") as f:
                procs[h] = host.popen(argv[h], env=env, stdout=f, stderr=subprocess.STDOUT)
        # both groups in one quorum (host a's metrics log the quorum's size when it changes),
        # then 20 more steps trained together
        _wait("a quorum of both hosts' groups",
              lambda: any(r.get("groups") == 2 for r in _records(metrics)), procs, logs)
        together = next(r["step"] for r in _records(metrics) if r.get("groups") == 2)
        _wait("steps together", lambda: any(r.get("step", 0) >= together + 20 for r in _records(metrics)), procs, logs)
        subprocess.run(b.cmd(["ip", "link", "set", b.ifname, "down"]), check=True, timeout=30)
        cut_at, cut = time.monotonic(), max(r.get("step", 0) for r in _records(metrics))
        ended: dict[str, float] = {}
        while len(ended) < 2 and time.monotonic() - cut_at < 120:
            ended |= {k: time.monotonic() - cut_at for k, p in procs.items() if k not in ended and p.poll() is not None}
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    out = {k: logs[k].read_text(errors="replace") for k in procs}
    assert len(ended) == 2, (ended, out)  # no hang on either host
    assert procs["a"].returncode == 0, out["a"][-3000:]
    summary = json.loads((run_a / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["fault_tolerance"]["restarts"] == [0, 0]
    record = json.loads((run_a / "replica-0.json").read_text())
    assert record["restart_count"] == 0
    # host a's group trained every step after the cut's step alone, and some with host b
    assert 20 <= STEPS - record["steps_short_of_groups"] <= cut - together + 50
    sizes = [(r["step"], r["groups"]) for r in _records(metrics) if "groups" in r]
    assert sizes[-1][1] == 1 and sizes[-1][0] > together + 20, sizes
    # host b's command ends by itself, with one line saying why, and no traceback
    assert procs["b"].returncode == 1, out["b"][-3000:]
    assert "Traceback (most recent" not in out["b"], out["b"][-3000:]
    assert "no quorum of fault_tolerance.min_replicas = 1" in out["b"].strip().splitlines()[-1], out["b"][-3000:]
    with capsys.disabled():
        print(f"\n[ft two hosts] {time.monotonic() - started:.1f} s; groups {sizes}; cut after step {cut}; "
              f"exits after the cut {ended}; host b: {out['b'].strip().splitlines()[-1]}")
