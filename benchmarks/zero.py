"""ZeRO benchmark (DataParallel ``strategy.shard``): held bytes and step time.

Same MLP as ``benchmarks/data_parallel.py`` (64 -> 2048 -> 896 -> 10, about 2M parameters),
fp32 Adam, digits batches, gloo processes on 127.0.0.1, one thread each.

* ``bytes``: for N = 2 and 4, at each level, the bytes one rank holds after a step
  (parameters + gradients + optimizer state, measured from the tensors it holds:
  :meth:`ZeroEngine.held_bytes`) over the ZeRO formula (ZeRO-1 ``8 + 8/N``, ZeRO-2
  ``4 + 12/N``, ZeRO-3 ``16/N`` bytes a parameter; goal within 10%).
* ``step_time``: at N = 2, median over repeats of (paratrain step at the level / torch
  ``ZeroRedundancyOptimizer`` over DDP step), the two measured back to back per repeat,
  order alternating (both: forward, backward, gradient exchange, Adam step, parameter
  all-gather). Goal <= 1.1 for ZeRO-1 (the like-for-like one). torch FSDP2
  (``fully_shard`` on each child and the root) is tried on the same gloo group; its ratio,
  or its error, is recorded, and ``step_time_ratio_zero3_vs_fsdp2`` pairs ZeRO-3 with it.
* ``max_param_diff_vs_torch_zero``: the two ZeRO-1 models after the same steps.
* ``peak_rss_over_start_mb_per_rank_N=2``: a fresh pair of processes per level trains 2
  steps of a 16.9M-parameter MLP of 17 layers (``RSS_HIDDEN``; unsharded fp32 Adam state
  257 MiB; ZeRO-3 gathers one layer at a time); the
  largest rank's peak resident memory (VmHWM) over its resident memory before the model
  was built, against a stated budget of ``RSS_BUDGET_MB`` per rank ("none" = torch DDP).

Prints one JSON object. ``--quick`` for a short run; ``--smoke`` for tiny MLPs, 2 steps and
N = 2 only (every code path, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance, warm_workers  # noqa: E402

HIDDEN = [2048, 896]
RSS_HIDDEN = [1024] * 16  # about 16.9M parameters in 17 units: unsharded fp32 Adam state 257 MiB
RSS_BUDGET_MB = 300  # per rank (set after a first measurement: DDP + Adam peaked at 337 MiB)
LEVELS = ("optimizer", "gradients", "parameters")
FORMULA = {"optimizer": lambda n: 8 + 8 / n, "gradients": lambda n: 4 + 12 / n,
           "parameters": lambda n: 16 / n}


def _job() -> Any:
    from paratrain.config import load_job

    return load_job({"run": {"name": "zero-bench", "seed": 0}, "model": {"name": "mlp", "hidden": HIDDEN},
                     "data": {"name": "digits"}, "train": {"optimizer": {"name": "adam", "lr": 1e-3}},
                     "strategy": {"type": "DataParallel", "num_replicas": 2,
                                  "aggregation": {"method": "AllReduce"}}})


def _model(seed: int) -> nn.Module:
    from paratrain.config.job import ModelSpec
    from paratrain.models import build_model

    torch.manual_seed(seed)
    return build_model(ModelSpec.model_validate({"name": "mlp", "hidden": HIDDEN}),
                       input_shape=(64,), num_classes=10)


def _batches(rank: int, steps: int, bs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from paratrain.config.job import DataSpec
    from paratrain.data import load_data

    x, y = load_data(DataSpec(), seed=0).train.tensors
    g = torch.Generator().manual_seed(rank)
    return [(x[idx], y[idx]) for idx in (torch.randint(0, len(y), (bs,), generator=g) for _ in range(steps))]


def _time(step: Any, batches: list[Any]) -> float:
    """Seconds per step, median over ``batches`` (a barrier before each)."""
    times = []
    for b in batches:
        dist.barrier()
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ours(ctx: Any, level: str) -> tuple[Any, Any]:
    """A ZeroEngine at ``level`` and the step function the one loop would run."""
    from paratrain.comm import collectives as C
    from paratrain.executors.shared.zero import ZeroEngine
    from paratrain.task import resolve_task
    from paratrain.training.loop import Trainer

    job = _job()
    eng = ZeroEngine(_model(0), resolve_task(job), None, ctx=ctx, precision="fp32", level=level,
                     units=None, local=set(), buffers=[], counter=C.CommCounter(),
                     bucket_bytes=25 * 1024 * 1024)
    opt = torch.optim.Adam(eng.model.parameters(), lr=1e-3)
    trainer = Trainer(eng, opt, job.train, 10**6)

    def step(b: Any) -> None:
        trainer.step([b])
        eng.after_step()

    return eng, (opt, step)


def bytes_worker(ctx: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    global HIDDEN
    HIDDEN = cfg["hidden"]
    torch.set_num_threads(1)
    batches = _batches(ctx.rank, 2, cfg["batch"])
    out: dict[str, Any] = {}
    for level in LEVELS:
        eng, (opt, step) = _ours(ctx, level)
        for b in batches:
            step(b)
        n_params = sum(p.numel() for p in eng.net.parameters())
        held = eng.held_bytes(opt)
        out[level] = {**held, "per_parameter": held["total"] / n_params,
                      "over_formula": held["total"] / (FORMULA[level](ctx.world_size) * n_params)}
        eng.close()
    return out


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_worker(ctx: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """A fresh process: peak resident memory (VmHWM) over its resident memory before the
    model was built (VmRSS), across 2 steps of the big MLP at ``cfg["level"]``."""
    global HIDDEN
    import ctypes

    try:  # glibc raises its mmap threshold after big frees, then keeps freed memory resident:
        # fixed here (this process only: not in the timed ones), the peak RSS follows the
        # tensors the process holds
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except OSError:
        pass
    torch.set_num_threads(1)
    HIDDEN = cfg["rss_hidden"]
    batches = _batches(ctx.rank, 2, cfg["batch"])
    start = _status_kb("VmRSS")
    if cfg["level"] == "none":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(_model(0), bucket_cap_mb=25, gradient_as_bucket_view=True)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        for b in batches:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(b[0]), b[1]).backward()
            opt.step()
        n_params = sum(p.numel() for p in net.parameters())
    else:
        eng, (_, step) = _ours(ctx, cfg["level"])
        for b in batches:
            step(b)
        n_params = sum(p.numel() for p in eng.net.parameters())
        eng.close()
    return {"peak_over_start_mb": (_status_kb("VmHWM") - start) / 1024, "parameters": n_params}


def time_worker(ctx: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    global HIDDEN
    HIDDEN = cfg["hidden"]
    torch.set_num_threads(1)
    batches = _batches(ctx.rank, cfg["steps"], cfg["batch"])
    loss_fn = nn.functional.cross_entropy
    ours = {level: _ours(ctx, level) for level in LEVELS}

    ref = DDP(_model(0), bucket_cap_mb=25, gradient_as_bucket_view=True)
    zopt = ZeroRedundancyOptimizer(ref.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)

    def step_torch(b: Any) -> None:
        zopt.zero_grad(set_to_none=True)
        loss_fn(ref(b[0]), b[1]).backward()
        zopt.step()

    steps: dict[str, Any] = {"torch_zero": step_torch, **{lv: ours[lv][1][1] for lv in LEVELS}}
    fsdp_error = None
    try:
        from torch.distributed.fsdp import fully_shard

        fs = _model(0)
        for m in fs.children():
            if any(True for _ in m.parameters()):
                fully_shard(m)
        fully_shard(fs)
        fopt = torch.optim.Adam(fs.parameters(), lr=1e-3)

        def step_fsdp(b: Any) -> None:
            fopt.zero_grad(set_to_none=True)
            loss_fn(fs(b[0]), b[1]).backward()
            fopt.step()

        step_fsdp(batches[0])
        steps["fsdp2"] = step_fsdp
    except Exception as e:  # noqa: BLE001 -- recorded: FSDP2 may not run on gloo/CPU
        fsdp_error = f"{type(e).__name__}: {str(e)[:200]}"
    for fn in steps.values():  # warm-up
        for b in batches[:2]:
            fn(b)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(cfg["repeats"]):
        order = list(steps.items())
        if rep % 2:
            order.reverse()
        for name, fn in order:
            times[name].append(_time(fn, batches))
    eng = ours["optimizer"][0]
    diff = max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(eng.net.parameters(), ref.module.parameters(), strict=True))
    for lv in LEVELS:
        ours[lv][0].close()
    return {"times": times, "fsdp_error": fsdp_error, "max_param_diff_vs_torch_zero": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny MLPs, 2 steps, 1 repeat, N = 2 only: every code path")
    args = ap.parse_args()
    from paratrain.comm.testing import run_distributed

    cfg: dict[str, Any] = {"batch": 64, "steps": 4 if args.quick else 8, "repeats": 9 if args.quick else 15,
                           "hidden": HIDDEN}
    rss_hidden, sizes = RSS_HIDDEN, (2, 4)
    if args.smoke:
        cfg = {"batch": 8, "steps": 2, "repeats": 1, "hidden": [32, 16]}
        rss_hidden, sizes = [32] * 2, (2,)
    out: dict[str, Any] = {"config": {**cfg, "optimizer": "adam fp32", "backend": "gloo"},
                           "goals": {"bytes_over_formula": "within 10%",
                                     "step_time_ratio_zero1_vs_torch_zero": "<= 1.1"}}
    warm_workers("torch.distributed.fsdp", "torch.distributed.optim")
    out["bytes"] = {}
    for n in sizes:
        res = run_distributed(bytes_worker, n, cfg, timeout_s=900)
        out["bytes"][f"N={n}"] = {lv: {"per_parameter": round(res[0][lv]["per_parameter"], 4),
                                        "over_formula": round(res[0][lv]["over_formula"], 4),
                                        "max_over_formula_any_rank": round(max(r[lv]["over_formula"] for r in res), 4),
                                        "total_bytes_rank0": res[0][lv]["total"]}
                                  for lv in LEVELS}
    # peak memory per rank on a model whose unsharded fp32 Adam state (16 bytes a parameter)
    # would not fit the budget: a fresh pair of processes per level
    rss = {}
    for level in ("none", *LEVELS):
        res = run_distributed(rss_worker, 2, {**cfg, "level": level, "rss_hidden": rss_hidden}, timeout_s=900)
        rss[level] = round(max(r["peak_over_start_mb"] for r in res), 1)
    n_big = res[0]["parameters"]
    out["peak_rss_over_start_mb_per_rank_N=2"] = rss
    out["peak_rss_model"] = {"hidden": rss_hidden, "parameter_count": n_big,
                             "unsharded_adam_fp32_mb": round(16 * n_big / 2**20, 1),
                             "budget_mb": RSS_BUDGET_MB,
                             "fits_budget": {k: v <= RSS_BUDGET_MB for k, v in rss.items()}}
    t = run_distributed(time_worker, 2, cfg, timeout_s=900)[0]
    ratios = {}
    base = t["times"]["torch_zero"]
    for name, ts in t["times"].items():
        if name != "torch_zero":
            ratios[name] = round(statistics.median(a / b for a, b in zip(ts, base, strict=True)), 4)
    out["step_time_ratio_vs_torch_zero"] = ratios
    if "fsdp2" in t["times"]:  # ZeRO-3 against its like: FSDP2 per child + root, same group
        out["step_time_ratio_zero3_vs_fsdp2"] = round(statistics.median(
            a / b for a, b in zip(t["times"]["parameters"], t["times"]["fsdp2"], strict=True)), 4)
    out["step_time_ms"] = {k: round(1e3 * statistics.median(v), 3) for k, v in t["times"].items()}
    out["fsdp2_on_gloo_cpu"] = t["fsdp_error"] or "ran"
    out["max_param_diff_vs_torch_zero"] = t["max_param_diff_vs_torch_zero"]
    out["provenance"] = provenance(out, modelled=("unsharded_adam_fp32_mb",),
                                   mixed=("over_formula", "max_over_formula_any_rank"),
                                   configured=("hidden", "parameter_count", "budget_mb"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
