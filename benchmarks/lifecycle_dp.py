"""Lifecycle cost of a short DataParallel job: ``paratrain run`` against torchrun + a plain DDP script.

Both sides train the same thing (scikit-learn digits, MLP 64 -> 128 -> 64 -> 10, SGD lr
0.1 momentum 0.9, 2 replicas x 16 rows, 20 steps, gloo on 127.0.0.1, one test evaluation
at the end, the trained model written to disk) and are timed as whole processes, launch
to exit, as a user's shell sees them:

* paratrain: ``paratrain run job.toml --overwrite -q`` at its defaults (preflight, the
  forkserver, the elastic launcher, checkpoints, metrics, summary, ``report.png``,
  ``model.safetensors``: everything a run writes);
* the peer: ``torchrun --nproc-per-node=2 --standalone benchmarks/_ddp_peer.py`` (torch's
  documented single-node launch; torchrun's own default of one intra-op thread per worker).

Each repeat runs both back to back, the order alternating; ``ratio_measured`` is the
median over repeats of paratrain's wall time over the peer's in the same repeat (paired).
The two trained models are compared tensor by tensor (``max_param_diff_measured``: 0.0
means the same steps were taken). Prints one JSON object. ``--repeats N`` (default 5;
``--quick``: 3; ``--smoke``: 1 repeat of 2 steps without the uncounted first runs, every
code path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = 20
JOB = """\
[run]
name = "lifecycle_dp"
seed = 0
output_dir = "{out}"

[model]
name = "mlp"
hidden = [128, 64]

[data]
name = "digits"

[train]
epochs = 1
max_steps = {steps}
batch_size = 16
optimizer = {{ name = "sgd", lr = 0.1, momentum = 0.9 }}

[strategy]
type = "DataParallel"
num_replicas = 2
aggregation = {{ method = "AllReduce" }}
"""


def _bin(name: str) -> str:
    """The console script installed next to this interpreter (the venv's)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def timed(cmd: list[str], env: dict[str, str] | None = None,
          cpu: list[float] | None = None) -> tuple[float, str]:
    """Wall seconds from start to exit of ``cmd`` (must exit 0), and its stdout; ``cpu``
    gets the CPU seconds (user + system) of it and every process it started and reaped --
    less moved than wall time by other work on a shared machine."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def paired(ours_cmd: list[str], peer_cmd: list[str], repeats: int, env: dict[str, str],
           cpu: tuple[list[float], list[float]] | None = None,
           warm: bool = True, peer_out: list[str] | None = None,
           after_ours: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Wall seconds of both commands, ``repeats`` times, back to back in alternating order,
    after one uncounted run of each (the page cache; ``warm=False``: none); ``cpu``: lists
    that get their CPU seconds (:func:`timed`); ``peer_out``: gets the peer's stdout of
    each counted run; ``after_ours``: called after each counted run of ours (its files)."""
    if warm:
        timed(ours_cmd, env)
        timed(peer_cmd, env)
    ours: list[float] = []
    peer: list[float] = []
    ours_cpu, peer_cpu = cpu if cpu is not None else ([], [])
    for rep in range(repeats):
        order = [(ours_cmd, ours, ours_cpu), (peer_cmd, peer, peer_cpu)]
        if rep % 2:
            order.reverse()
        for cmd, acc, acc_cpu in order:
            wall, stdout = timed(cmd, env, acc_cpu)
            acc.append(wall)
            if cmd is peer_cmd and peer_out is not None:
                peer_out.append(stdout)
            if cmd is ours_cmd and after_ours is not None:
                after_ours()
    return ours, peer


def max_diff(peer_pt: Path, ours: Path) -> float:
    """Largest absolute difference between the peer's saved state_dict and paratrain's
    ``model.safetensors``, tensor by tensor (inf when the names differ; a tied tensor the
    peer saved under a second name is compared once)."""
    import torch
    from safetensors.torch import load_file

    a, b = torch.load(peer_pt, weights_only=True), load_file(str(ours))
    a = {k: v for k, v in a.items() if k in b}
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument("--smoke", action="store_true", help="1 repeat of 2 steps, no warm-up run: every code path")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 3
    if args.smoke:
        args.repeats, args.steps = 1, 2
    tmp = Path(tempfile.mkdtemp(prefix="lifecycle-dp-"))
    job = tmp / "job.toml"
    job.write_text(JOB.format(out=tmp / "runs", steps=args.steps))
    ours_cmd = [_bin("paratrain"), "run", str(job), "--overwrite", "-q"]
    peer_pt = tmp / "peer.pt"
    peer_cmd = [_bin("torchrun"), "--nproc-per-node=2", "--standalone", str(HERE / "_ddp_peer.py"),
                str(peer_pt), str(args.steps)]
    # each side at its own thread default; --smoke checks code paths, not times: the
    # caller's thread setting (the smoke test's OMP_NUM_THREADS=1) stays
    drop = ("PARATRAIN_DEBUG",) if args.smoke else ("OMP_NUM_THREADS", "PARATRAIN_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    load0 = os.getloadavg()[0]
    cpu: tuple[list[float], list[float]] = ([], [])
    ours, peer = paired(ours_cmd, peer_cmd, args.repeats, env, cpu, warm=not args.smoke)
    ratios = [a / b for a, b in zip(ours, peer, strict=True)]
    summary = json.loads((tmp / "runs" / "lifecycle_dp" / "summary.json").read_text())
    results: dict[str, Any] = {
        "benchmark": "lifecycle_dp",
        "cores": os.cpu_count(),
        "load_average_at_start": round(load0, 2),
        "config": {"steps": args.steps, "replicas": 2, "batch_per_replica": 16, "repeats": args.repeats,
                   "peer": "torchrun --nproc-per-node=2 --standalone benchmarks/_ddp_peer.py (DDP, gloo)"},
        "ratio_measured": round(median(ratios), 4),
        "ratios_measured": [round(r, 4) for r in ratios],
        # CPU seconds of each whole process tree: what the lifecycle costs, less moved by
        # other work on a shared machine than the wall ratio above
        "cpu_ratio_measured": round(median([a / b for a, b in zip(*cpu, strict=True)]), 4),
        "cpu_s_measured": {"paratrain_median": round(median(cpu[0]), 3), "peer_median": round(median(cpu[1]), 3)},
        "wall_s_measured": {"paratrain_median": round(median(ours), 3), "peer_median": round(median(peer), 3),
                            "paratrain": [round(x, 3) for x in ours], "peer": [round(x, 3) for x in peer]},
        "max_param_diff_measured": max_diff(peer_pt, tmp / "runs" / "lifecycle_dp" / "model.safetensors"),
        "paratrain_test_accuracy_measured": summary.get("test_accuracy"),
        "goals": {"ratio_measured": "<= 1.0"},
    }
    results["provenance"] = provenance(results, configured=("cores",))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
