"""Lifecycle cost of the GPT demo: ``paratrain run`` against a one-file bare PyTorch loop.

``examples/gpt_shakespeare_local.toml`` shortened to 300 steps (and ``eval_every`` to 100,
keeping the demo's three test evaluations per run) is run as a whole process, launch to
exit, at paratrain's defaults (preflight, checkpoints, metrics, the bigram baseline,
``report.png``, ``model.safetensors``, the digest: everything a run does), against
``benchmarks/_bare_gpt_peer.py``: the same corpus and model code, seed, data order,
optimizer, steps and evaluations, and nothing else. The peer runs on the intra-op thread
count paratrain picks by default (1: ``paratrain.training.threads``), so that the ratio is
the lifecycle's cost, not a thread setting's.

Each repeat runs both back to back, the order alternating; ``ratio_measured`` is the median
of paratrain's wall time over the peer's in the same repeat. The two trained models are
compared tensor by tensor (``max_param_diff_measured``). ``threads`` times the peer's
training step with 1 thread and with torch's default (one per core), paired repeats
(``--threads-repeats 0`` skips it). Prints one JSON object. ``--quick``: 3 repeats of 150
steps (evaluations every 50); ``--smoke``: 1 repeat of 4 steps, one evaluation, without the
uncounted first runs (every code path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance  # noqa: E402
from lifecycle_dp import _bin, max_diff, paired, timed  # noqa: E402

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "gpt_shakespeare_local.toml"


def _job(src: str, out: Path, steps: int, eval_every: int) -> str:
    """The example with its output folder, step count and evaluation cadence replaced."""
    lines = []
    for line in src.splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "max_steps":
            line = f"max_steps = {steps}"
        elif key == "eval_every":
            line = f"eval_every = {eval_every}"
        lines.append(line)
        if line.strip() == "[run]":
            lines.append(f'output_dir = "{out}"')
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads-repeats", type=int, default=3)
    ap.add_argument("--threads-steps", type=int, default=30, help="steps of each threads timing")
    ap.add_argument("--quick", action="store_true", help="3 repeats of 150 steps, 2 threads repeats")
    ap.add_argument("--smoke", action="store_true", help="1 repeat of 4 steps, no warm-up run: every code path")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps, args.eval_every, args.threads_repeats = 3, 150, 50, 2
    if args.smoke:
        args.repeats, args.steps, args.eval_every, args.threads_repeats, args.threads_steps = 1, 4, 4, 1, 3
    tmp = Path(tempfile.mkdtemp(prefix="lifecycle-gpt-"))
    job = tmp / "job.toml"
    job.write_text(_job(EXAMPLE.read_text(), tmp / "runs", args.steps, args.eval_every))
    name = "gpt_shakespeare_local"
    ours_cmd = [_bin("paratrain"), "run", str(job), "--overwrite", "-q"]
    peer_pt = tmp / "peer.pt"
    peer = [sys.executable, str(HERE / "_bare_gpt_peer.py"), str(peer_pt)]
    peer_cmd = [*peer, str(args.steps), str(args.eval_every), "1"]
    # each side at its own thread default; --smoke checks code paths, not times: the
    # caller's thread setting (the smoke test's OMP_NUM_THREADS=1) stays
    drop = ("PARATRAIN_DEBUG",) if args.smoke else ("OMP_NUM_THREADS", "PARATRAIN_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    load0 = os.getloadavg()[0]
    cpu: tuple[list[float], list[float]] = ([], [])
    outs: list[str] = []
    ours, bare = paired(ours_cmd, peer_cmd, args.repeats, env, cpu, warm=not args.smoke, peer_out=outs)
    ratios = [a / b for a, b in zip(ours, bare, strict=True)]
    summary = json.loads((tmp / "runs" / name / "summary.json").read_text())
    peer_out = json.loads(outs[-1].strip().splitlines()[-1])
    results: dict[str, Any] = {
        "benchmark": "lifecycle_gpt",
        "cores": os.cpu_count(),
        "load_average_at_start": round(load0, 2),
        "config": {"steps": args.steps, "eval_every": args.eval_every, "repeats": args.repeats,
                   "peer": "benchmarks/_bare_gpt_peer.py (one file, bare loop, 1 thread)"},
        "ratio_measured": round(median(ratios), 4),
        "ratios_measured": [round(r, 4) for r in ratios],
        # CPU seconds of each whole process tree: what the lifecycle costs, less moved by
        # other work on a shared machine than the wall ratio above
        "cpu_ratio_measured": round(median([a / b for a, b in zip(*cpu, strict=True)]), 4),
        "cpu_s_measured": {"paratrain_median": round(median(cpu[0]), 3), "peer_median": round(median(cpu[1]), 3)},
        "wall_s_measured": {"paratrain_median": round(median(ours), 3), "peer_median": round(median(bare), 3),
                            "paratrain": [round(x, 3) for x in ours], "peer": [round(x, 3) for x in bare]},
        "max_param_diff_measured": max_diff(peer_pt, tmp / "runs" / name / "model.safetensors"),
        "test_loss_measured": {"paratrain": summary.get("test_loss"), "peer": peer_out["test_loss"]},
        "goals": {"ratio_measured": "<= 1.05"},
    }
    if args.threads_repeats > 0:
        one: list[float] = []
        default: list[float] = []
        for rep in range(args.threads_repeats):
            order = [("1", one), ("0", default)]
            if rep % 2:
                order.reverse()
            for threads, acc in order:
                out = timed([*peer, str(args.threads_steps), "-1", threads], env)[1]
                acc.append(float(json.loads(out.strip().splitlines()[-1])["median_step_s"]))
        results["threads"] = {
            "step_s_1_thread_measured": round(median(one), 4),
            "step_s_torch_default_measured": round(median(default), 4),
            "torch_default_threads": os.cpu_count(), "steps": args.threads_steps,
            "default_over_1_measured": round(median([d / o for o, d in zip(one, default, strict=True)]), 3),
        }
    results["provenance"] = provenance(results, configured=("cores", "torch_default_threads", "steps"))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
