"""Private memory of training on a token file (``[data] name = "tokens"``): 200 M tokens
against 20 M.

Two uint16 files of random ids below ``--vocab`` (20 M and 200 M tokens: 40 MB and 400 MB)
and one held-out file (100 k tokens) are written to a temporary folder. Each run trains a
tiny GPT (``language_model``, block 256, batch 16, ``--steps`` steps, one test
evaluation and the bigram reference over the whole training file at the end) in a fresh
process, which samples its own ``RssAnon`` (``/proc/self/status``: the anonymous, private
pages; the mapped file's page cache is ``RssFile``) every 5 ms on a thread and reports the
peak and its ``VmHWM`` (peak total RSS, file pages included). Each repeat runs both sizes
back to back (order alternating), for ``sequential`` and ``random`` sampling;
``ratio_measured`` is the median over repeats of peak RssAnon (200 M) / peak RssAnon
(20 M). Prints one JSON object. ``--quick``: 1 repeat; ``--smoke``: 20 k against 200 k
tokens, 1 repeat of 2 steps, random sampling only (every code path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _status(key: str) -> int:
    """``key`` of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(path: str, test: str, sampling: str, steps: int, out: str) -> None:
    """One measured run (in its own process)."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    import paratrain

    start = _status("RssAnon")
    summary = paratrain.fit({
        "run": {"name": "m", "seed": 0, "output_dir": out, "progress_every": "off"},
        "task": {"name": "language_model", "block_size": 256},
        "data": {"name": "tokens", "path": path, "test_path": test, "sampling": sampling},
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 0.0},
        "train": {"epochs": 1, "max_steps": steps, "batch_size": 16,
                  "optimizer": {"name": "adamw", "lr": 1e-3}},
    }, overwrite=True)
    done.set()
    peak[0] = max(peak[0], _status("RssAnon"))
    print(json.dumps({"peak_rss_anon": peak[0], "rss_anon_after_import": start,
                      "vm_hwm": _status("VmHWM"), "steps": summary["steps"],
                      "bigram": "bigram_test_loss" in summary}))


def _run(path: Path, test: Path, sampling: str, steps: int, tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, __file__, "--child", str(path), str(test), sampling,
                          str(steps), str(tmp / "runs")], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="1 repeat")
    ap.add_argument("--smoke", action="store_true",
                    help="20 k against 200 k tokens, 1 repeat of 2 steps, random sampling: every code path")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    sizes = {"20M": 20_000_000, "200M": 200_000_000}
    if args.smoke:
        args.repeats, args.steps = 1, 2
        sizes = {"20k": 20_000, "200k": 200_000}
    small, big = sizes
    results: dict[str, Any] = {"benchmark": "tokens_memory",
                               "config": {"steps": args.steps, "vocab": args.vocab,
                                          "repeats": args.repeats, "block_size": 256,
                                          "batch_size": 16}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rng = np.random.default_rng(0)
        files = {}
        for name, n in sizes.items():
            files[name] = tmp / f"{name}.bin"
            with files[name].open("wb") as f:
                for a in range(0, n, 10_000_000):  # written in chunks: this process stays small
                    f.write(rng.integers(0, args.vocab, min(10_000_000, n - a), dtype=np.uint16).tobytes())
        test = tmp / "val.bin"
        rng.integers(0, args.vocab, 10_000 if args.smoke else 100_000, dtype=np.uint16).tofile(test)
        # --smoke: one sampling (the other is the same code here, another setting of the run)
        for sampling in (("random",) if args.smoke else ("sequential", "random")):
            peaks: dict[str, list[int]] = {k: [] for k in sizes}
            hwm: dict[str, list[int]] = {k: [] for k in sizes}
            ratios = []
            for r in range(args.repeats):
                got = {}
                for name in (sizes if r % 2 == 0 else reversed(list(sizes))):
                    got[name] = _run(files[name], test, sampling, args.steps, tmp)
                    peaks[name].append(got[name]["peak_rss_anon"])
                    hwm[name].append(got[name]["vm_hwm"])
                ratios.append(got[big]["peak_rss_anon"] / got[small]["peak_rss_anon"])
            results[sampling] = {
                f"peak_rss_anon_mb_{small}": median(peaks[small]) / 2**20,
                f"peak_rss_anon_mb_{big}": median(peaks[big]) / 2**20,
                f"vm_hwm_mb_{small}": median(hwm[small]) / 2**20,
                f"vm_hwm_mb_{big}": median(hwm[big]) / 2**20,
                "ratio_measured": median(ratios), "ratios": [round(x, 4) for x in ratios],
                "bigram_reference_computed": bool(got[big]["bigram"]),
            }
    results["goal"] = "ratio <= 1.10"
    results["provenance"] = provenance(results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
