"""Workers forked from the torch-preloaded forkserver see what a spawned worker would: the
parent's environment, directory, import path and stdout/stderr *now*, not the server's from
when it started (paratrain.comm.forkserver)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.comm.testing import run_distributed


def report(ctx: Any) -> dict[str, Any]:
    print(f"hello from rank {ctx.rank}", flush=True)
    print(f"err from rank {ctx.rank}", file=sys.stderr, flush=True)
    import only_on_parent_path  # type: ignore[import-not-found]

    return {"env": os.environ.get("PARATRAIN_FS_PROBE"), "cwd": os.getcwd(),
            "mod": only_on_parent_path.VALUE, "rank_env": os.environ.get("RANK")}


def test_children_take_the_parents_current_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    run_distributed(_noop, 2)  # the server is running from here on
    (tmp_path / "only_on_parent_path.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PARATRAIN_FS_PROBE", "set-after-the-server-started")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    capfd.readouterr()
    out = run_distributed(report, 2)
    captured = capfd.readouterr()
    for r in out:
        assert r["env"] == "set-after-the-server-started"
        assert r["cwd"] == str(work) and r["mod"] == 42
    assert "hello from rank 0" in captured.out and "hello from rank 1" in captured.out
    assert "err from rank 1" in captured.err
    monkeypatch.delenv("PARATRAIN_FS_PROBE")
    assert all(r["env"] is None for r in run_distributed(report, 2))


def _noop(ctx: Any) -> int:
    return int(ctx.rank)


_LOCK_HELD_AT_EXIT = """
from paratrain.comm.forkserver import context
if __name__ == "__main__":
    ctx = context()
    lock = ctx.Lock()  # a named semaphore this process still holds when it exits
    p = ctx.Process(target=print, args=("child",))
    p.start(); p.join()
"""


def test_exit_with_a_live_lock_prints_no_traceback(tmp_path: Path) -> None:
    """The exit hook closes the resource tracker, which frees every semaphore still
    registered; multiprocessing's own exit then unlinked the lock's again and printed a
    FileNotFoundError traceback (seen after paratrain.fit in a script). It frees them first."""
    import subprocess

    script = tmp_path / "lock_at_exit.py"
    script.write_text(_LOCK_HELD_AT_EXIT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "child", out.stderr
    assert "Traceback" not in out.stderr and "leaked" not in out.stderr, out.stderr


FROZEN_SCRIPT = """
import gc, json, sys

def child(q):
    q.put({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "torch": "torch" in sys.modules})

if __name__ == "__main__":
    from paratrain.comm.forkserver import context
    ctx = context()
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(json.dumps(q.get(timeout=120)))
    p.join()
"""


def test_a_worker_inherits_the_servers_frozen_heap_with_the_collector_on(tmp_path: Path) -> None:
    """A fresh process's server (not the test session's): it froze what it imported (torch's
    few hundred thousand objects), so a worker's start-up collection skips them."""
    import json
    import subprocess

    script = tmp_path / "frozen_probe.py"
    script.write_text(FROZEN_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                         timeout=180, cwd=tmp_path)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["enabled"] and r["torch"] and r["frozen"] > 100_000, r
