"""freeze_startup_objects: a full GC pass after the freeze skips what import created."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json, time
import torch  # noqa: F401  (hundreds of thousands of long-lived objects)
import paratrain.executors.model_parallel.runner  # noqa: F401

def full_pass():
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter(); gc.collect(); best = min(best, time.perf_counter() - t)
    return best

before = full_pass()
from paratrain.training.gcfreeze import freeze_startup_objects
frozen = freeze_startup_objects()
after = full_pass()
print(json.dumps({"before": before, "after": after, "frozen": frozen,
                  "count": gc.get_freeze_count()}))
"""


def test_full_collection_skips_frozen_startup_objects() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frozen"] == r["count"] > 50_000
    # A full pass over torch's import-time objects takes tens of ms; after the freeze it
    # walks only what came later (measured: ~20x less). Generous margin for a noisy host.
    assert r["after"] < r["before"] / 3, r
