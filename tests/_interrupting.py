"""Helpers of the tests that stop a real ``paratrain run`` CLI process (signals, SIGKILL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_cli(job: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``paratrain run JOB -q EXTRA...`` in its own session (``os.killpg(proc.pid, SIGINT)``
    is Ctrl-C: the CLI and every worker it started), one torch thread per process."""
    return subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "run", str(job), "-q", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=ROOT,
    )


def wait_until(done: Callable[[], bool], proc: subprocess.Popen[str], *, timeout_s: float = 180,
               what: str = "") -> None:
    """Poll ``done()`` every 5 ms while ``proc`` runs; fail when it ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"timed out waiting for {what or done}"
        time.sleep(0.005)
