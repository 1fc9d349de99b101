"""Compression benchmark: time vs the memory-copy floor, wire bytes vs the information minimum.

For float32 tensors of 1M and 25M elements (``--quick``: 1M and 4M), per method:

* ``time_ratio``: median compress+decompress time divided by the median time of
  ``tensor.clone()`` (the memory-copy floor), both measured in this run, interleaved,
  on one thread, as thread CPU time (robust to other processes on a shared machine);
* ``wire_ratio``: ``len(to_bytes())`` divided by the information minimum
  (values at the dtype + min(32-bit indices, bitmap) for TopK/Threshold, values only
  for RandomK, ceil(n*bits/8) for Quantization);
* ``peer_ratio`` for TopK: our time divided by ``torch.topk(|x|, k)`` + scatter (the
  plain selection), the peer the goal refers to.

Goals (issue 3): wire_ratio <= 1.01 for every method; TopK 1% on the largest size,
Threshold and Quantization <= 3x the copy floor. Prints one JSON object. ``--smoke``: 100k and
400k elements, one repeat (every code path, a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance  # noqa: E402

from paratrain.compression import Compressor, decompress, information_minimum


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    # CPU time of this thread (torch runs single-threaded here): on a shared machine
    # wall time mostly measures other processes; CPU time still includes page faults.
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def _methods(n: int) -> dict[str, dict[str, Any]]:
    k = n // 100
    return {
        "None": {"method": "None"},
        "TopK_1pct": {"method": "TopK", "k": k},
        "RandomK_1pct": {"method": "RandomK", "k": k},
        # |x| > 2.5758 keeps ~1% of a standard normal
        "Threshold_1pct": {"method": "Threshold", "threshold": 2.5758},
        "Quantization_8bit": {"method": "Quantization", "bits": 8},
        "Quantization_4bit": {"method": "Quantization", "bits": 4},
        "Quantization_8bit_deterministic": {"method": "Quantization", "bits": 8},
        "ErrorFeedback_TopK_1pct": {
            "method": "ErrorFeedback", "error_compensation": True,
            "base_strategy": {"method": "TopK", "k": k},
        },
    }


GOALS = {"TopK_1pct": 3.0, "Threshold_1pct": 3.0, "Quantization_8bit": 3.0,
         "Quantization_4bit": 3.0, "Quantization_8bit_deterministic": 3.0}


def bench_size(n: int, repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    out: dict[str, Any] = {"numel": n, "methods": {}}
    clone_times: list[float] = []
    for name, strategy in _methods(n).items():
        comp = Compressor(
            strategy, seed=0, stochastic_rounding=not name.endswith("deterministic")
        )

        def run(comp: Compressor = comp) -> torch.Tensor:
            return decompress(comp.compress("x", x))

        run()  # warm-up (allocator, first-touch)
        ms, floor = [], []
        for _ in range(repeats):  # interleave so both see the same machine load
            floor.append(_median_ms(lambda: x.clone(), 1))
            ms.append(_median_ms(run, 1))
        t, f = statistics.median(ms), statistics.median(floor)
        clone_times += floor
        c = comp.compress("x", x)
        blob = c.to_bytes()
        t_ser = _median_ms(lambda c=c: c.to_bytes(), max(1, repeats // 2))
        entry: dict[str, Any] = {
            "ms": round(t, 3),
            "copy_floor_ms": round(f, 3),
            "time_ratio": round(t / f, 3),
            "wire_bytes": len(blob),
            "information_minimum": information_minimum(c),
            "wire_ratio": round(len(blob) / information_minimum(c), 5),
            "to_bytes_ms": round(t_ser, 3),
        }
        if name in GOALS:
            entry["time_goal"] = GOALS[name]
            entry["meets_time_goal"] = t / f <= GOALS[name]
        entry["meets_wire_goal"] = len(blob) <= 1.01 * information_minimum(c)
        if name == "TopK_1pct":
            k = n // 100

            def peer(k: int = k) -> torch.Tensor:
                idx = torch.topk(x.abs(), k, sorted=False).indices
                dense = torch.zeros_like(x)
                dense[idx] = x[idx]
                return dense

            peer()
            p = statistics.median(
                [_median_ms(peer, 1) for _ in range(max(1, min(repeats, 5)))]
            )
            entry["peer_torch_topk_ms"] = round(p, 3)
            entry["peer_time_ratio_to_copy"] = round(p / f, 3)
            entry["speedup_vs_torch_topk"] = round(p / t, 3)
        out["methods"][name] = entry
    out["copy_floor_ms"] = round(statistics.median(clone_times), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M and 4M elements, 3 repeats")
    ap.add_argument("--smoke", action="store_true", help="100k and 400k elements, 1 repeat: every code path")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = ([100_000, 400_000] if args.smoke else [1_000_000, 4_000_000] if args.quick
             else [1_000_000, 25_000_000])
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 7)
    result: dict[str, Any] = {
        "benchmark": "compression",
        "what": "compress+decompress time / tensor.clone() time; wire bytes / information minimum",
        "threads": args.threads,
        "repeats": repeats,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        # Small sizes are cheap and noisier: three times the repeats.
        "sizes": {
            str(n): bench_size(n, repeats * (3 if n <= 1_000_000 else 1)) for n in sizes
        },
    }
    largest = result["sizes"][str(sizes[-1])]["methods"]
    result["summary"] = {
        "all_wire_within_1pct": all(
            m["meets_wire_goal"] for s in result["sizes"].values() for m in s["methods"].values()
        ),
        "largest_time_ratios": {k: v["time_ratio"] for k, v in largest.items()},
        "topk_speedup_vs_torch_topk": largest["TopK_1pct"]["speedup_vs_torch_topk"],
    }
    # information_minimum is a formula (the bytes the kept values and their positions need)
    result["provenance"] = provenance(result, modelled=("information_minimum",), mixed=("wire_ratio",),
                                      configured=("numel", "threads", "repeats", "cpu_count", "time_goal"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
