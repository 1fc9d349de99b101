"""Steps/s through a failure: DataParallel with ``[fault_tolerance]`` (torchft) against today's restart from the last checkpoint.

One job (scikit-learn digits, MLP 64 -> 128 -> 64 -> 10, SGD lr 0.1 momentum 0.9, 2 replicas x
16 rows, ``--steps`` steps, a checkpoint every ``--steps / 4``) and one failure: replica 1's
process is SIGKILLed after step ``kill = 3 steps / 8`` (``PARATRAIN_FAULT_KILL``, the first
attempt only), with ``run.max_restarts = 1``. Arms, each a whole ``paratrain run`` process
(launch to exit):

* ``restart``: plain DataParallel; torch's elastic agent restarts both workers, which resume
  from the last checkpoint and train its steps since again;
* ``fault_tolerant``: ``[fault_tolerance]`` (``min_replicas = 1``, ``heartbeat_timeout_s =
  2``, ``join_timeout_s = 0.5``, a Lighthouse paratrain starts): replica 1 alone is restarted
  and heals from replica 0, which goes on alone meanwhile;

and each arm once without the failure, so ``failure_cost_s`` is the wall time the failure
added. ``steps_per_s`` = steps / whole-process wall time; ``heal_s`` = from the supervisor's
restart of replica 1 to its having a live peer's state; ``steps_short_of_groups``: steps
replica 0 took alone (replica 1's shard of those steps is not trained). Medians over
``--repeats`` (default 3; ``--quick`` 1 of 400 steps; ``--smoke`` 1 of 16 steps), after one
uncounted run (none at ``--smoke``, whose runs are ``paratrain.cli.main`` calls in the
benchmark's own process: its one forkserver forks every run's workers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance  # noqa: E402
from lifecycle_dp import JOB, _bin  # noqa: E402

FT_TABLE = """
[fault_tolerance]
min_replicas = 1
heartbeat_timeout_s = 2
join_timeout_s = 0.5
"""


def run_arm(tmp: Path, name: str, steps: int, *, tolerant: bool, kill: int | None,
            in_process: bool = False) -> dict[str, Any]:
    """One ``paratrain run`` of the job: its wall time and summary (and replica 1's record);
    ``in_process`` (``--smoke``): the command run in this process (``paratrain.cli.main``,
    the environment set and put back around it), every arm's workers forked from this
    process's one forkserver, not a new process importing torch and starting its own."""
    out = tmp / name
    text = JOB.format(out=out, steps=steps).replace('name = "lifecycle_dp"', f'name = "{name}"')
    text = text.replace("seed = 0", f"seed = 0\nmax_restarts = 1\ncheckpoint_every = {max(1, steps // 4)}")
    text = text.replace("epochs = 1\n", "epochs = 1000\n")  # max_steps is the budget
    job = tmp / f"{name}.toml"
    job.write_text(text + (FT_TABLE if tolerant else ""))
    env = {k: v for k, v in os.environ.items() if k not in ("PARATRAIN_DEBUG", "PARATRAIN_FAULT_KILL")}
    if kill is not None:
        env["PARATRAIN_FAULT_KILL"] = f"1:{kill}"
    t0 = time.perf_counter()
    if in_process:
        from paratrain.cli import main as cli

        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            code = cli(["run", str(job), "--overwrite", "-q"])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        wall = time.perf_counter() - t0
        if code != 0:
            raise SystemExit(f"{name} returned {code}")
    else:
        proc = subprocess.run([_bin("paratrain"), "run", str(job), "--overwrite", "-q"], capture_output=True,
                              text=True, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    run_dir = out / name
    summary = json.loads((run_dir / "summary.json").read_text())
    replica = run_dir / "replica-1.json"
    return {"wall": wall, "summary": summary,
            "replica1": json.loads(replica.read_text()) if replica.exists() else None,
            "replica0": json.loads((run_dir / "replica-0.json").read_text()) if tolerant else None}


def heal_s(arm: dict[str, Any]) -> float | None:
    """Replica 1's restart (the supervisor's clock) to its holding a live peer's state."""
    restarted = arm["summary"]["fault_tolerance"]["restarted_at"].get("1", [])
    healed = (arm["replica1"] or {}).get("healed_at")
    return healed - restarted[-1] if restarted and healed else None


def measure(tmp: Path, steps: int, repeats: int, *, warm: bool) -> dict[str, Any]:
    """Every arm (``warm=False``, ``--smoke``: no uncounted run, every arm in this process)."""
    kill = 3 * steps // 8
    if warm:  # uncounted: the page cache and the first forkserver
        run_arm(tmp, "warm", steps, tolerant=True, kill=None)
    walls: dict[str, list[float]] = {}
    heals: list[float] = []
    short: list[int] = []
    digests: dict[str, str] = {}
    for rep in range(repeats):
        order = [("restart", False), ("fault_tolerant", True)]
        for arm, tolerant in order if rep % 2 == 0 else order[::-1]:
            for failing in (False, True):
                key = f"{arm}{'_failure' if failing else '_clean'}"
                r = run_arm(tmp, key, steps, tolerant=tolerant, kill=kill if failing else None,
                            in_process=not warm)
                assert r["summary"]["steps"] == steps
                walls.setdefault(key, []).append(r["wall"])
                digests[key] = r["summary"]["parameters_sha256"]
                if tolerant and failing:
                    assert r["summary"]["fault_tolerance"]["restarts"] == [0, 1], r["summary"]
                    h = heal_s(r)
                    if h is not None:
                        heals.append(h)
                    short.append(int(r["replica0"]["steps_short_of_groups"]))
    wall = {k: median(v) for k, v in walls.items()}
    arms = {arm: {"steps_per_s_measured": round(steps / wall[f"{arm}_failure"], 3),
                  "wall_s_measured": round(wall[f"{arm}_failure"], 3),
                  "clean_wall_s_measured": round(wall[f"{arm}_clean"], 3),
                  "failure_cost_s_measured": round(wall[f"{arm}_failure"] - wall[f"{arm}_clean"], 3)}
            for arm in ("restart", "fault_tolerant")}
    return {"config": {"steps": steps, "kill_after_step": kill, "checkpoint_every": max(1, steps // 4),
                       "replicas": 2, "batch_per_replica": 16, "repeats": repeats},
            **arms,
            "speedup_through_failure_measured": round(wall["restart_failure"] / wall["fault_tolerant_failure"], 4),
            "heal_s_measured": round(median(heals), 3) if heals else None,
            "steps_alone_measured": median([float(x) for x in short]) if short else None,
            # the restart arm ends with the failure-free parameters (exact resume); the
            # fault-tolerant one does not when replica 0 took steps alone
            "restart_equals_clean": digests["restart_failure"] == digests["restart_clean"],
            "fault_tolerant_clean_equals_plain": digests["fault_tolerant_clean"] == digests["restart_clean"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 400 steps")
    ap.add_argument("--smoke", action="store_true", help="1 repeat of 16 steps: every code path")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 400
    if args.smoke:
        args.repeats, args.steps = 1, 16
    load0 = os.getloadavg()[0]
    results: dict[str, Any] = {"benchmark": "fault_tolerance", "cores": os.cpu_count(),
                               "load_average_at_start": round(load0, 2),
                               **measure(Path(tempfile.mkdtemp(prefix="fault-tolerance-")), args.steps,
                                         args.repeats, warm=not args.smoke)}
    results["provenance"] = provenance(results, configured=("cores",))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
