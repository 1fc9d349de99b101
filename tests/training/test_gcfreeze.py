"""freeze_startup_objects: a full GC pass after the freeze skips what import created."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def _result(script: str) -> dict[str, Any]:
    """The JSON object the last line of ``python -c script`` printed."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return r


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
    r = _result(SCRIPT)
    assert r["frozen"] == r["count"] > 50_000
    # A full pass over torch's import-time objects takes tens of ms; after the freeze it
    # walks only what came later (measured: ~20x less). Generous margin for a noisy host.
    assert r["after"] < r["before"] / 3, r


PAUSE_SCRIPT = """
import gc, json, weakref
from paratrain.training import gcfreeze

out = {"enabled_before": gc.isenabled()}
gcfreeze.resume_collections()  # no pause yet: nothing happens
gcfreeze.freeze_for_exit()  # not claimed: nothing happens
out["frozen_unowned"] = gc.get_freeze_count()

gcfreeze.own_process(pause=True)
out["enabled_paused"] = gc.isenabled()


class Node:
    pass


a, b = Node(), Node()
a.other, b.other = b, a  # a cycle: only the collector frees it
ref = weakref.ref(a)
gcfreeze.watch_garbage(a)
del a, b
out["alive_before_resume"] = ref() is not None
gcfreeze.resume_collections()
out["alive_after_resume"] = ref() is not None  # collected before the freeze
out["enabled_after"] = gc.isenabled()
out["frozen_after"] = gc.get_freeze_count()
print(json.dumps(out))
"""


def test_the_commands_own_process_pauses_then_freezes_what_start_up_built() -> None:
    r = _result(PAUSE_SCRIPT)
    assert r["enabled_before"] and r["frozen_unowned"] == 0
    assert not r["enabled_paused"]
    assert r["alive_before_resume"] and not r["alive_after_resume"]  # a watched cycle is not kept
    assert r["enabled_after"] and r["frozen_after"] > 0


def test_main_called_with_argv_leaves_the_callers_collector_alone(capsys: object) -> None:
    import gc

    from paratrain.cli import main

    frozen = gc.get_freeze_count()
    assert main(["schema", "strategy"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen


FIRST_IMPORTS_SCRIPT = """
import gc, json
from paratrain.training.gcfreeze import first_imports

out = {}
with first_imports():
    out["paused"] = not gc.isenabled()
    import json.decoder  # noqa: F401
out["enabled"], out["frozen"] = gc.isenabled(), gc.get_freeze_count()
gc.unfreeze()
with first_imports():  # the second time in a process: neither paused nor frozen again
    out["paused_again"] = not gc.isenabled()
out["frozen_again"] = gc.get_freeze_count()
print(json.dumps(out))
"""


def test_first_imports_pauses_and_freezes_once_a_process() -> None:
    r = _result(FIRST_IMPORTS_SCRIPT)
    assert r["paused"] and r["enabled"] and r["frozen"] > 1000
    assert not r["paused_again"] and r["frozen_again"] == 0  # a later message's garbage is not kept
