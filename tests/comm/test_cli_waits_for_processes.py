"""Issue 20 item 6: ``paratrain run`` returns only when every process it started has
ended. A 2-worker DataParallel job runs through the CLI in its own session; right after
the CLI exits, no process of that session is still alive (the forkserver, its workers and
multiprocessing's resource tracker included), so a script that starts the next job or
removes the run folder at once races nothing. Processes are found by a /proc scan of the
session id (zombies, already dead, do not count)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_data_parallel_torchrun import JOB, _env

from paratrain.training.faults import FAULT_ENV

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")


def _alive_in_session(sid: int) -> list[str]:
    """``pid state cmdline`` of every process whose session id is ``sid`` and not a zombie."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended while we looked
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            out.append(f"{entry.name} {fields[0]} {cmd[:160]}")
    return out


@pytest.mark.parametrize("fault", [None, "1:2"], ids=["finished", "worker_killed"])
def test_run_returns_after_every_process_it_started_has_ended(tmp_path: Path, fault: str | None) -> None:
    job = tmp_path / "dp.toml"  # 2 replicas, 6 steps, no restarts
    job.write_text(JOB.format(name="dp", out=tmp_path / "runs"))
    env = _env()
    if fault is not None:  # rank 1 SIGKILLs itself after step 2: the launch's error path
        env[FAULT_ENV] = fault
    # output to a file, not a pipe: reading a pipe to its end would wait for every
    # process holding it, and hide the race this test is about
    log = tmp_path / "cli.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "paratrain.cli", "run", str(job), "-q"],
                                cwd=tmp_path, env=env, start_new_session=True, stdout=f, stderr=f)
        code = proc.wait(timeout=300)
    left = _alive_in_session(proc.pid)  # at once: a lingering process is still there
    assert code == (0 if fault is None else 1), log.read_text()
    assert (tmp_path / "runs" / "dp" / "summary.json").exists() == (fault is None)
    assert left == [], "still alive after `paratrain run` returned:\n" + "\n".join(left)


def test_stop_reaps_the_server_and_a_later_launch_starts_a_fresh_one() -> None:
    import multiprocessing.forkserver
    import time

    from paratrain.comm.forkserver import context, stop

    ctx = context()
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert pid is not None and Path(f"/proc/{pid}").exists()
    stop()
    assert not Path(f"/proc/{pid}").exists()  # ended and reaped (no zombie left either)
    stop()  # nothing running: a no-op
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    assert p.exitcode == 0
