"""2-D tensor parallelism benchmark: BlockWise on a 2 x 2 grid vs 1-D Megatron at tp = 4.

On 4 real gloo ranks, a 4-layer MLP (hidden 1024) built from the same weights, at a small
and a large batch:

- step time (forward + backward) of paratrain's ``BlockWise`` grid layers vs torch's
  ``ColwiseParallel``/``RowwiseParallel`` (1-D, Megatron) on the same 4 ranks, interleaved,
  medians of repeats;
- bytes this rank sends per step (ring cost model: modelled; also the payload handed to
  the collectives, measured at each call) vs what 1-D Megatron sends at tp = 4 (modelled)
  (fwd: one all-reduce per pair; bwd: the second pair's input gradient; each all-reduce
  of ``n`` bytes sends ``2 (p - 1) / p n``). 2-D moves weight panels (independent of the
  batch) and activation panels of ``1/g`` of the batch, so it wins when ``B * H`` is
  large against ``H^2``: the two batches show both sides;
- per-rank parameter memory vs the dense model (ideal ``1/tp``; 1-D leaves the row
  layers' biases replicated, 2-D keeps each bias on ``g`` ranks).

``python benchmarks/tensor_parallel_2d.py [--quick | --smoke]`` prints one JSON object
(``--smoke``: hidden 64, one repeat: every code path in seconds). Four
processes time-share the 2 cores of CI, so read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import provenance, warm_workers  # noqa: E402

from paratrain.comm.context import WorkerContext  # noqa: E402
from paratrain.comm.testing import run_distributed  # noqa: E402
from paratrain.config import TensorParallelismConfig  # noqa: E402
from paratrain.tensor_parallel import parallelize  # noqa: E402

H = 1024


def dense_mlp(h: int = H) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        fc0=nn.Linear(h, h), act0=nn.GELU(), fc1=nn.Linear(h, h), act1=nn.GELU(),
        fc2=nn.Linear(h, h), act2=nn.GELU(), fc3=nn.Linear(h, h)))


def worker(ctx: WorkerContext, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.set_num_threads(1)
    tp = ctx.world_size
    mesh = init_device_mesh("cpu", (tp,))
    h = cfg["hidden"]
    dense = dense_mlp(h)
    ours = parallelize(copy.deepcopy(dense), TensorParallelismConfig(
        tensor_parallel_size=tp, partitioning_strategy="BlockWise", memory_optimization="None"))
    ref = copy.deepcopy(dense)
    parallelize_module(ref, mesh, {"fc0": ColwiseParallel(), "fc1": RowwiseParallel(),
                                   "fc2": ColwiseParallel(), "fc3": RowwiseParallel()})
    dense_bytes = sum(p.numel() * 4 for p in dense.parameters())
    ref_local = sum(p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4
                    for p in ref.parameters())
    out: dict[str, Any] = {}
    for rows in cfg["batches"]:
        x = torch.randn(rows, h, generator=torch.Generator().manual_seed(1))

        def step(m: nn.Module, x: torch.Tensor = x) -> None:
            m(x).square().mean().backward()
            m.zero_grad(set_to_none=True)

        for _ in range(2):
            step(ours)
            step(ref)
        t_ours: list[float] = []
        t_ref: list[float] = []
        for r in range(cfg["reps"]):
            pair = [(ours, t_ours), (ref, t_ref)]
            for m, acc in (pair if r % 2 == 0 else pair[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                step(m)
                acc.append(time.perf_counter() - t0)
        ours.stats.reset()
        step(ours)
        st = ours.statistics()
        n = rows * h * 4
        megatron = 3 * 2 * (tp - 1) / tp * n  # 2 all-reduces forward, 1 backward
        out[str(rows)] = {
            "step_s_blockwise": statistics.median(t_ours),
            "step_s_torch_1d": statistics.median(t_ref),
            "step_time_ratio_vs_torch_1d": statistics.median(t_ours) / statistics.median(t_ref),
            "bytes_sent_per_step_blockwise_modelled": st["bytes_sent_modelled"],
            "payload_bytes_per_step_blockwise_measured": st["payload_bytes_measured"],
            "bytes_per_step_megatron_1d_modelled": megatron,
            "bytes_ratio_vs_megatron_1d": st["bytes_sent_modelled"] / megatron,
            "collectives_blockwise": st["collectives"],
        }
    out["param_memory_fraction_blockwise"] = st["param_memory_fraction"]
    out["param_memory_fraction_torch_1d"] = ref_local / dense_bytes
    out["ideal_fraction_modelled"] = 1 / tp
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="hidden 64, batches 4 and 64, 1 repeat: every code path")
    args = ap.parse_args()
    cfg = {"hidden": H, "batches": [64, 2048], "reps": 3 if args.quick else 11}
    if args.smoke:
        cfg = {"hidden": 64, "batches": [4, 64], "reps": 1}
    t0 = time.perf_counter()
    warm_workers("torch.distributed.tensor.parallel")
    res = run_distributed(worker, 4, cfg, timeout_s=900)
    doc: dict[str, Any] = {
        "benchmark": "tensor_parallel_2d",
        "peer": "torch.distributed.tensor.parallel ColwiseParallel/RowwiseParallel (1-D) at tp=4",
        "model": f"MLP 4 x Linear({cfg['hidden']}, {cfg['hidden']}), GELU",
        "config": cfg,
        "grid": "2 x 2 (BlockWise, tensor_parallel_size 4)",
        "backend": "gloo (CPU)",
        "paratrain_config": "memory_optimization None on both sides (neither recomputes)",
        "timing": "medians of interleaved repeats, alternating order",
        "rank0": res[0],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    doc["provenance"] = provenance(doc, modelled=("bytes_ratio_vs_megatron_1d",))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
