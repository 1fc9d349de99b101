"""DataLoader workers on a transform-heavy dataset: ``[data] num_workers = 2`` against 0.

A map-style dataset whose ``__getitem__`` draws a random augmentation and then spends about
``--work-ms`` of numpy arithmetic per item (a decode / crop / colour-jitter pipeline's cost;
BLAS held to one thread) feeds a small MLP under the Local strategy. Each repeat trains the
same job with 0 and with 2 loader workers back to back (the order alternating) and times
the optimizer steps from step ``--warm`` to the last from the run's own ``metrics.jsonl``
(``time_s`` of its evaluations), so start-up (preflight, model build, forking the
workers) is not counted. ``ratio_measured`` is the median over the repeats of
``steps/s (2 workers) / steps/s (0 workers)``. Prints one JSON object; ``--quick`` for a
short run, ``--smoke`` for the tiniest (every code path, a few seconds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per process: the workers
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # are the parallelism measured here

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance  # noqa: E402


def _rounds_for(ms: float) -> int:
    """Rounds of the 64 x 64 transform that take about ``ms`` milliseconds of CPU here (the
    fastest of 7 timings: other processes only slow a timing down)."""
    a = np.full((64, 64), 0.5)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(40):
            a = np.tanh(a @ a.T * 1e-3 + 0.1)
        best = min(best, (time.perf_counter() - t) / 40 * 1e3)
    return max(1, round(ms / best))


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points of y = sin(3x) (x in 16 features), a random shift per item, ``rounds`` of work."""

    def __init__(self, n: int, rounds: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 16, generator=g)
        self.y = torch.sin(3 * self.x.sum(1, keepdim=True))
        self.rounds = rounds

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.01 * torch.randn(16)  # the augmentation
        a = np.full((64, 64), float(x[0]))
        for _ in range(self.rounds):  # the transform's cost
            a = np.tanh(a @ a.T * 1e-3 + 0.1)
        return x + 1e-9 * float(a.mean()), self.y[i]


class Task:
    name = "augmented_regression"
    fitness_metric = "mse"
    fitness_mode: Literal["max", "min"] = "min"

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def datasets(self, seed: int) -> tuple[Any, Any]:
        del seed
        return Augmented(4096, self.rounds), Augmented(32, 0)

    def build_model(self, model_spec: Any, train: Any) -> nn.Module:
        del model_spec, train
        return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return (output - batch[1]).pow(2).mean()

    def eval_batch(self, output: torch.Tensor, batch: Any) -> dict[str, float]:
        return {"sq": float((output - batch[1]).pow(2).sum()), "count": float(len(output))}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        mse = sums.get("sq", 0.0) / max(sums.get("count", 0.0), 1.0)
        return {"loss": mse, "mse": mse}


def steps_per_s(out: Path, name: str, workers: int, args: argparse.Namespace, rounds: int) -> float:
    import paratrain

    job = {"run": {"name": name, "seed": 0, "output_dir": str(out), "progress_every": "off"},
           "data": {"num_workers": workers},
           "train": {"epochs": 1, "max_steps": args.steps, "batch_size": args.batch,
                     "eval_every": args.warm, "optimizer": {"name": "sgd", "lr": 0.05}}}
    paratrain.fit(job, task=Task(rounds), overwrite=True)
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    t = {r["step"]: r["time_s"] for r in records if "time_s" in r}
    return (args.steps - args.warm) / (t[args.steps] - t[args.warm])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work-ms", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="2 repeats of 40 steps")
    ap.add_argument("--smoke", action="store_true", help="1 repeat of 4 steps: every code path")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warm = 2, 40, 10
    if args.smoke:
        args.repeats, args.steps, args.warm, args.batch = 1, 4, 2, 4
    rounds = _rounds_for(args.work_ms)
    per = {0: [], 2: []}  # type: dict[int, list[float]]
    ratios = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            got = {}
            for w in ((0, 2) if r % 2 == 0 else (2, 0)):
                got[w] = steps_per_s(Path(tmp), f"w{w}", w, args, rounds)
                per[w].append(got[w])
            ratios.append(got[2] / got[0])
    results: dict[str, Any] = {
        "benchmark": "dataloader_workers",
        "config": {"steps": args.steps, "timed_from_step": args.warm, "batch_size": args.batch,
                   "work_ms_per_item": args.work_ms, "rounds_per_item": rounds,
                   "repeats": args.repeats, "cpu_count": os.cpu_count()},
        "steps_per_s_0_workers": median(per[0]), "steps_per_s_2_workers": median(per[2]),
        "ratio_measured": median(ratios), "ratios": [round(x, 3) for x in ratios],
        "load_average_1min_at_start": load, "goal": ">= 1.6",
    }
    results["provenance"] = provenance(results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
