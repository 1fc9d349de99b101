"""ZeRO x tensor parallelism on one ``dp 2 x tp 2`` mesh (4 gloo processes): held bytes
and step time against tensor parallel x DataParallel without ZeRO, on the same model.

MLP 64 -> H -> H -> 10 on digits (``fc0`` column-, ``fc1`` row-parallel, the head and
``fc1.bias`` replicated), fp32 AdamW, batches of ``BATCH`` rows per replica, one thread a
rank. For each ``shard`` in none / optimizer / gradients / parameters, every rank builds
the run's engine (:class:`TensorParallelEngine` with the data-parallel GradSync for none,
:class:`MeshZeroEngine` otherwise) and trains ``STEPS`` steps after 2 warm-up steps:

* ``held_bytes``: rank 0's parameters + gradients + AdamW moments after a step, measured
  from the tensors it holds (each storage once), and the formula for the level with the
  TP shard's elements ``P_sharded / 2 + P_replicated`` per TP rank (the ZeRO formulas of
  ``benchmarks/zero.py`` over dp = 2).
* ``step_time_s``: the median over the steps of rank 0's step (forward, backward, exchanges,
  clipping norm, AdamW); ``ratio_vs_none``: its ratio to the run without ZeRO. The machine
  is shared, so ratios of medians, not absolute times, are the figures.

Prints one JSON object. ``--quick`` for a short run, ``--smoke`` for the tiniest (every code
path, seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance, warm_workers  # noqa: E402

LEVELS = ("none", "optimizer", "gradients", "parameters")
FORMULA = {"none": lambda n: 16.0, "optimizer": lambda n: 8 + 8 / n,
           "gradients": lambda n: 4 + 12 / n, "parameters": lambda n: 16 / n}
BATCH = 64


def _held(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, extra: list[Any]) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*params, *(p.grad for p in params), *extra,
              *(v for st in optimizer.state.values() for v in st.values())]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


def worker(ctx: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from paratrain.comm.collectives import CommCounter, broadcast_module_
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.config import load_job
    from paratrain.executors.tensor_parallel.engine import TensorParallelEngine
    from paratrain.executors.tensor_parallel.runner import dp_order
    from paratrain.executors.tensor_parallel.zero import MeshZeroEngine
    from paratrain.task import resolve_task
    from paratrain.tensor_parallel import parallelize
    from paratrain.training import build_optimizer, seed_everything
    from paratrain.training.loop import Trainer

    torch.set_num_threads(1)
    groups = build_tp_groups(2)
    out: dict[str, Any] = {}
    for level in LEVELS:
        job = load_job({"run": {"name": "mesh-bench", "seed": 0},
                        "model": {"name": "mlp", "hidden": [cfg["hidden"]] * 2}, "data": {"name": "digits"},
                        "train": {"batch_size": BATCH, "grad_clip_norm": 1.0,
                                  "optimizer": {"name": "adamw", "lr": 1e-3}},
                        "tensor_parallel": {"tensor_parallel_size": 2, "memory_optimization": "None"}})
        assert job.tensor_parallel is not None
        seed_everything(0)
        task = resolve_task(job)
        train, _ = task.datasets(0)
        model = task.build_model(job.model, train)
        broadcast_module_(model)
        n_sharded = sum(p.numel() for n, p in model.named_parameters() if n in ("fc0.weight", "fc0.bias",
                                                                                 "fc1.weight"))
        n_repl = sum(p.numel() for p in model.parameters()) - n_sharded
        engine: Any
        if level == "none":
            tpm = parallelize(model, job.tensor_parallel, groups)
            engine = TensorParallelEngine(tpm, task, None, device=torch.device("cpu"))
            params = list(tpm.parameters())
            extra: list[Any] = []
        else:
            tpm = parallelize(model, job.tensor_parallel, dataclasses.replace(groups, dp=None))
            engine = MeshZeroEngine(tpm, task, None, groups=groups, device=torch.device("cpu"),
                                    is_main=ctx.is_main, world_group=ctx.group, precision="fp32",
                                    level=level, units=None, micro_batches=1, broadcast_buffers=True,
                                    counter=CommCounter(), bucket_bytes=25 << 20)
            params = [*tpm.parameters(), *engine.model.parameters()]
            extra = [u.shard for u in engine.units] + [u.grad for u in engine.units]
        opt = build_optimizer(engine.model.parameters(), job.train.optimizer)
        trainer = Trainer(engine, opt, job.train, 10_000)
        rows = dp_order(len(train), dp=2, replica=groups.tp_index, seed=0, epoch=0)
        times = []
        for step in range(cfg["steps"] + 2):
            k = step % (len(rows) // BATCH)  # the replica's batches, round and round
            batch = train[rows[k * BATCH:(k + 1) * BATCH]]
            t0 = time.perf_counter()
            trainer.step([batch])
            engine.after_step()
            if step >= 2:
                times.append(time.perf_counter() - t0)
        held = _held(params, opt, extra)
        per_rank_elems = n_sharded / 2 + n_repl  # a TP rank's shard
        out[level] = {"held_bytes": held, "formula_bytes": FORMULA[level](2) * per_rank_elems,
                      "step_time_s": median(times)}
        if hasattr(engine, "close"):
            engine.close()
        out["n_parameters"] = n_sharded + n_repl
    groups.tp.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 timed steps")
    ap.add_argument("--smoke", action="store_true", help="hidden 32, 1 timed step: every code path")
    args = ap.parse_args()
    from paratrain.comm.testing import run_distributed

    cfg = {"hidden": 32 if args.smoke else 1024, "steps": 1 if args.smoke else 8 if args.quick else 20}
    warm_workers("torch.distributed.tensor.parallel")
    r = run_distributed(worker, 4, cfg, timeout_s=900)[0]
    base = r["none"]["step_time_s"]
    levels = {lvl: {**r[lvl], "held_over_formula": r[lvl]["held_bytes"] / r[lvl]["formula_bytes"],
                    "ratio_vs_none": r[lvl]["step_time_s"] / base} for lvl in LEVELS}
    result = {"config": {**cfg, "mesh": "dp 2 x tp 2", "batch_per_replica": BATCH,
                         "parameters": r["n_parameters"]}, "levels": levels}
    result["provenance"] = provenance(result, modelled=("formula_bytes",), mixed=("held_over_formula",))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
