"""glibc's heap settings of a training process (``paratrain.training.allocator``): with them a
40 MB buffer allocated and freed 20 times (as a step's activations are), after 10 warm-up
rounds, reuses the pages it
first faulted in; with glibc's defaults (a request over 32 MB is always a fresh ``mmap``)
every allocation faults its pages in again. Medians: the kernel may still reclaim kept but
unused pages now and then on a loaded machine (one refault among 19 was seen in the
suite), which is not what is tested. Each case runs in a fresh interpreter (the setting is
process-wide and cannot be undone)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")

# The probe imports the loop, as every training process has, and measures the steady state
# after 10 warm-up steps, as a training loop runs: on a young heap the small allocations made
# between two 40 MB requests can land after the freed chunk, which then cannot hold the next
# aligned request (posix_memalign asks for the alignment on top), so the heap grows a few
# times (up to 6 seen) before a freed chunk fits; measured from the first request, that was
# flaky. A training process: a 300-step GPT run takes 0.5 s of system time kept, 2.7-4.3 s not.
PROBE = """
import json, resource, torch
import paratrain.training.loop
from paratrain.training.allocator import keep_freed_memory
set_ = keep_freed_memory()
faults = []
for i in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(10 * 1024 * 1024, dtype=torch.float32)  # 40 MB
    t.fill_(1.0)
    del t
    if i >= 10:
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"set": set_, "faults": faults}))
"""
# whether the settings are made, only (no torch, no allocations: the environment decides)
SET_ONLY = """
import json
from paratrain.training.allocator import keep_freed_memory
print(json.dumps({"set": keep_freed_memory()}))
"""


def _probe(script: str = PROBE, **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                          "PARATRAIN_KEEP_FREED_MEMORY")}
    out = subprocess.run([sys.executable, "-c", script], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def test_freed_buffers_are_reused_without_new_page_faults() -> None:
    on = _probe()
    if not on["set"]:
        pytest.skip("not glibc: the allocator settings do not apply")
    off = _probe(PARATRAIN_KEEP_FREED_MEMORY="0")
    assert off["set"] is False
    pages = 40 * 1024 * 1024 // 4096
    on_f, off_f = list(on["faults"]), list(off["faults"])  # type: ignore[call-overload]
    # glibc's default: each 40 MB request is a fresh mapping, faulted in again every time
    assert statistics.median(off_f) > pages // 2, off_f
    # kept: in the steady state the same pages are reused
    assert statistics.median(on_f) < pages // 20, on_f
    assert sum(on_f) < sum(off_f) // 4, (on_f, off_f)


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"},
                                 {"MALLOC_MMAP_THRESHOLD_": "131072"}])
def test_a_heap_tuned_by_the_environment_is_left_alone(env: dict[str, str]) -> None:
    assert _probe(SET_ONLY, **env)["set"] is False
