"""Fault injection for the kill-a-worker tests and demos.

``PARATRAIN_FAULT_KILL=RANK:STEP`` makes that rank SIGKILL itself right after optimizer
step STEP on the first attempt only (``restart_count == 0``), so the elastic agent's
restart and the resume-from-checkpoint path are exercised by a real process death.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_ENV", "maybe_kill"]

FAULT_ENV = "PARATRAIN_FAULT_KILL"


def maybe_kill(*, rank: int, step: int, restart_count: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or restart_count > 0:
        return
    rank_s, _, step_s = spec.partition(":")
    if int(rank_s) == rank and int(step_s) == step:
        os.kill(os.getpid(), signal.SIGKILL)
