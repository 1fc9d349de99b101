"""Pipeline schedules benchmark: 1F1B, Interleaved1F1B and ZBH1, ours and torch's.

For p in {2, 4} stages (one gloo process each, CPU) and m in {8, 16} micro-batches, the
token MLP of ``benchmarks/model_parallel.py`` (``Embedding`` then ``4p`` blocks ``Linear +
ReLU`` then a head) is cut into p equal stages (1F1B, ZBH1) or 2p equal chunks placed
round-robin (Interleaved1F1B, ``virtual_stages = 2``). Per configuration and schedule,
steps interleaved with torch's on the same split, in the same processes:

- ``bubble_measured``: ``1 - C_max / T`` (``C_max`` the busiest rank's compute time in the
  step, ``T`` the step, the slowest rank's), over ``bubble_theory_modelled``: 1F1B
  ``(p-1)/(m+p-1)``, Interleaved1F1B ``(p-1)/(2m+p-1)``, ZBH1 ``(p-1)/(3m+p-1)`` (F = B = W);
  ``bubble_replay_modelled``: the schedule replayed with the step's measured action times
  and free communication (ZBH1's real B and W are not equal to F, which the formula assumes);
- ``zbh1_step_over_1f1b``: ZBH1's median step over our 1F1B's, with both peaks of
  activation bytes held for backward (equal peak memory is the ZB-H1 premise) and the
  replayed ratio (modelled);
- ``isolated_stage``: one stage (4 blocks, width 1024, 128 rows) timed in one process:
  ``F``, one ``backward()``, and the split ``B`` and ``W`` (measured); ZBH1's step over
  1F1B's replayed with those costs (modelled), what the schedule gives where the ranks do
  not compete for cores;
- ``step_over_torch``: our Interleaved1F1B over torch's ``ScheduleInterleaved1F1B`` (two
  stages per rank, the same chunks), our ZBH1 over torch's ``ScheduleInterleavedZeroBubble``
  (one stage per rank: its ZB1P, the same split), our 1F1B over ``Schedule1F1B``; an error
  of torch's on gloo is recorded instead of a ratio.

Each process sets glibc's allocator as every paratrain worker does
(:func:`paratrain.training.allocator.keep_freed_memory`); torch's steps run in the same
processes. Steps are separated by a barrier; every repeat runs every schedule (ours and torch's, in
rotating order), and the ``*_paired_median`` ratios are medians of one repeat's ratios. Prints one JSON object.
``--quick``: fewer repeats; ``--smoke``: one repeat of a tiny model on 3 stages (every code
path, seconds). Shared machine: see ``cores_per_stage`` and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import provenance, warm_workers  # noqa: E402
from model_parallel import build, nodes  # noqa: E402

from paratrain.comm.p2p import P2PTransport  # noqa: E402
from paratrain.comm.testing import run_distributed  # noqa: E402
from paratrain.config.strategy import Partition  # noqa: E402
from paratrain.executors.model_parallel.plan import build_plan  # noqa: E402
from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules  # noqa: E402
from paratrain.executors.model_parallel.schedule import schedule, simulate, theoretical_bubble  # noqa: E402
from paratrain.training.allocator import keep_freed_memory  # noqa: E402
from paratrain.training.gcfreeze import freeze_startup_objects  # noqa: E402

SCHEDS = ("1F1B", "Interleaved1F1B", "ZBH1")
TORCH = {"1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
         "ZBH1": "ScheduleInterleavedZeroBubble"}


def chunks(model: nn.Sequential, n: int) -> list[list[str]]:
    """``n`` runs of equally many blocks; the embedding joins the first, the head the last."""
    names = nodes(model)
    body = names[1:-1]
    per = len(body) // n
    out = [body[k * per:(k + 1) * per] for k in range(n)]
    return [(["embed"] if k == 0 else []) + c + (["head"] if k == n - 1 else []) for k, c in enumerate(out)]


def _torch_schedule(name: str, model: nn.Sequential, split: list[list[str]], rank: int, p: int,
                    m: int) -> Any:
    from torch.distributed import pipelining as pp

    mine = [k for k in range(len(split)) if k % p == rank]
    stages = [pp.PipelineStage(nn.Sequential(*[model.get_submodule(n) for n in split[k]]), k,
                               len(split), torch.device("cpu")) for k in mine]
    loss = lambda out, target: nn.functional.cross_entropy(out, target)  # noqa: E731
    cls = getattr(pp, TORCH[name])
    return cls(stages[0] if name == "1F1B" else stages, m, loss_fn=loss)


def worker(ctx: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every schedule (ours and torch's) set up once, then timed round-robin: each repeat
    runs every (schedule, m) once, ours and torch's back to back in alternating order, so
    a slow minute of the shared machine falls on all of them alike (paired repeats)."""
    torch.set_num_threads(1)
    freeze_startup_objects()
    keep_freed_memory()  # as in every paratrain worker; torch's steps share these processes
    p, rows = ctx.world_size, cfg["rows"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (rows,), generator=g)
    y = torch.randint(0, 10, (rows,), generator=g)
    transport = P2PTransport(ctx.group)
    setups: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for name in SCHEDS:
        v = 2 if name == "Interleaved1F1B" else 1
        model = build(cfg["width"], cfg["blocks_per_stage"] * p)
        split = chunks(model, v * p)
        parts = [Partition.model_validate({"node_ids": ns, "target": {"WorkerId": f"worker-{k % p}"}})
                 for k, ns in enumerate(split)]
        plan = build_plan(model, parts, ctx.workers, contiguous=v == 1)
        rt = StageRuntime(plan, ctx.rank, segment_modules(model, plan, ctx.rank), transport,
                          attrs=held_attrs(model, plan, ctx.rank))
        ref_model = build(cfg["width"], cfg["blocks_per_stage"] * p)
        setups[name] = (model, rt, ref_model)
        for m in cfg["ms"]:
            res: dict[str, Any] = {"ours": [], "torch": [], "busy": [], "costs": [], "peak": 0,
                                   "torch_error": None, "sched": None}
            try:
                res["sched"] = _torch_schedule(name, ref_model, split, ctx.rank, p, m)
            except Exception as e:  # recorded, not fatal: torch's schedule on gloo/CPU
                res["torch_error"] = f"{type(e).__name__}: {e}"[:300]
            out[f"{name}/{m}"] = res
    calls = 0
    for rep in range(cfg["warmup"] + cfg["repeats"]):
        for m in cfg["ms"]:
            for k in range(len(SCHEDS)):
                name = SCHEDS[(k + rep) % len(SCHEDS)]
                model, rt, ref_model = setups[name]
                res = out[f"{name}/{m}"]
                for impl in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
                    tsched = res["sched"]
                    if impl == "torch" and (tsched is None or res["torch_error"]):
                        continue
                    model.zero_grad(set_to_none=True)
                    ref_model.zero_grad(set_to_none=True)
                    dist.barrier()
                    t0 = time.perf_counter()
                    if impl == "ours":
                        rt.train_step(x, y, step=calls, micro_batch_size=rows // m, schedule_name=name)
                        calls += 1
                    else:
                        try:
                            if ctx.rank == 0:
                                tsched.step(x)
                            elif ctx.rank == p - 1:
                                tsched.step(target=y)
                            else:
                                tsched.step()
                        except Exception as e:
                            res["torch_error"] = f"{type(e).__name__}: {e}"[:300]
                    dt = time.perf_counter() - t0
                    if rep >= cfg["warmup"]:
                        res[impl].append(dt)
                        if impl == "ours":
                            res["busy"].append(rt.stats.compute_s)
                            res["peak"] = max(res["peak"], rt.stats.peak_activation_bytes)
                            res["costs"].append({(k_, i, s): b - a for k_, i, s, a, b in rt.stats.trace})
    dist.barrier()
    for res in out.values():
        res.pop("sched")
    return out


def _paired_median(per_rank: list[dict[str, Any]], num: tuple[str, str], den: tuple[str, str]) -> float | None:
    """Median over repeats of one step's time over another's from the same repeat (each a
    step's slowest rank)."""
    a = [r[num[0]][num[1]] for r in per_rank]
    b = [r[den[0]][den[1]] for r in per_rank]
    if not a[0] or not b[0] or len(a[0]) != len(b[0]):
        return None
    return statistics.median(max(x[i] for x in a) / max(x[i] for x in b) for i in range(len(a[0])))


def _median_step(per_rank: list[dict[str, Any]], key: str, impl: str) -> float | None:
    runs = [r[key][impl] for r in per_rank]
    if not runs[0] or any(len(x) != len(runs[0]) for x in runs):
        return None
    return statistics.median(max(x[i] for x in runs) for i in range(len(runs[0])))


def measure(p: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    per_rank = run_distributed(worker, p, cfg, timeout_s=900)
    out = []
    for m in cfg["ms"]:
        row: dict[str, Any] = {"stages": p, "micro_batches": m,
                               "cores_per_stage": round((os.cpu_count() or 1) / p, 2)}
        for name in SCHEDS:
            key = f"{name}/{m}"
            v = 2 if name == "Interleaved1F1B" else 1
            n = len(per_rank[0][key]["ours"])
            steps = [max(r[key]["ours"][i] for r in per_rank) for i in range(n)]
            bubble = statistics.median(1 - max(r[key]["busy"][i] for r in per_rank) / steps[i] for i in range(n))
            orders = [schedule(name, s, p, m, v) for s in range(p)]
            replay = statistics.median(
                simulate(orders, costs={a: c for r in per_rank for a, c in r[key]["costs"][i].items()}).bubble
                for i in range(n))
            makespans = [simulate(orders, costs={a: c for r in per_rank for a, c in r[key]["costs"][i].items()}).makespan
                         for i in range(n)]
            theory = theoretical_bubble(p, m, name, v)
            ours = statistics.median(steps)
            ref = _median_step(per_rank, key, "torch")
            err = next((r[key]["torch_error"] for r in per_rank if r[key]["torch_error"]), None)
            row[name] = {
                "step_s_median": round(ours, 5),
                "bubble_measured": round(bubble, 4),
                "bubble_theory_modelled": round(theory, 4),
                "bubble_over_theory": round(bubble / theory, 3),
                "bubble_replay_modelled": round(replay, 4),
                "replay_makespan_s_modelled": round(statistics.median(makespans), 5),
                "peak_activation_bytes_per_stage": [r[key]["peak"] for r in per_rank],
                "torch_schedule": TORCH[name],
                "torch_step_s_median": None if ref is None or err else round(ref, 5),
                "step_over_torch": None if ref is None or err else round(ours / ref, 3),
                "step_over_torch_paired_median": None if ref is None or err else round(
                    _paired_median(per_rank, (key, "ours"), (key, "torch")) or 0.0, 3),
                "torch_error": err,
            }
        zb, one = row["ZBH1"], row["1F1B"]
        row["zbh1_step_over_1f1b"] = round(zb["step_s_median"] / one["step_s_median"], 3)
        row["zbh1_over_1f1b_paired_median"] = round(
            _paired_median(per_rank, (f"ZBH1/{m}", "ours"), (f"1F1B/{m}", "ours")) or 0.0, 3)
        row["zbh1_replay_over_1f1b_replay_modelled"] = round(
            zb["replay_makespan_s_modelled"] / one["replay_makespan_s_modelled"], 3)
        row["zbh1_peak_over_1f1b_peak"] = round(
            max(zb["peak_activation_bytes_per_stage"]) / max(one["peak_activation_bytes_per_stage"]), 3)
        out.append(row)
    return out


def isolated_costs(width: int, rows: int, blocks: int, repeats: int) -> dict[str, float]:
    """One stage's step times in one process (no other rank competing; the weights'
    gradients accumulating, as over a step's micro-batches): forward ``F``,
    one ``backward()`` (1F1B's B), and the split passes ``B`` (input gradients) and ``W``
    (weight gradients) of :mod:`paratrain.executors.model_parallel.backward_split`;
    medians, alternating the two backwards."""
    from paratrain.executors.model_parallel.backward_split import backward_inputs

    torch.manual_seed(0)
    stage = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())])
    times: dict[str, list[float]] = {"F": [], "full": [], "B": [], "W": []}
    for rep in range(repeats + 2):
        for split in (rep % 2 == 0, rep % 2 == 1):
            x = torch.randn(rows, width, requires_grad=True)
            t0 = time.perf_counter()
            y = stage(x)
            t1 = time.perf_counter()
            g = torch.randn_like(y)
            t2 = time.perf_counter()
            if split:
                w = backward_inputs([y], [g], [x])
                t3 = time.perf_counter()
                w.run()
            else:
                torch.autograd.backward([y], [g])
                t3 = time.perf_counter()
            t4 = time.perf_counter()  # gradients accumulate, as over a step's micro-batches
            if rep >= 2:
                times["F"].append(t1 - t0)
                if split:
                    times["B"].append(t3 - t2)
                    times["W"].append(t4 - t3)
                else:
                    times["full"].append(t3 - t2)
    return {k: statistics.median(v) for k, v in times.items()}


def modelled_zbh1(costs: dict[str, float], p: int, m: int) -> dict[str, float]:
    """ZBH1 over 1F1B replayed with the isolated stage costs (equal stages, free messages)."""
    one = simulate([schedule("1F1B", r, p, m) for r in range(p)], t_f=costs["F"], t_b=costs["full"])
    zb = simulate([schedule("ZBH1", r, p, m) for r in range(p)], t_f=costs["F"], t_b=costs["B"], t_w=costs["W"])
    return {"stages": p, "micro_batches": m, "zbh1_over_1f1b_modelled": round(zb.makespan / one.makespan, 3),
            "zbh1_bubble_modelled": round(zb.bubble, 4), "one_f_one_b_bubble_modelled": round(one.bubble, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--isolated-only", action="store_true",
                    help="only the one-process stage costs and their modelled ZBH1/1F1B ratio")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline sizes p (processes)")
    ap.add_argument("--width", type=int, default=256, help="the token MLP's width")
    ap.add_argument("--rows", type=int, default=256, help="rows per batch (split into m micro-batches)")
    ap.add_argument("--repeats", type=int, default=0, help="timed repeats (default 9, 3 with --quick)")
    ap.add_argument("--smoke", action="store_true", help="3 stages (a first, a middle and a last), "
                    "m = 6, width 16, 1 repeat: every code path")
    args = ap.parse_args()
    cfg = {"ms": [8, 16], "width": args.width, "rows": args.rows, "blocks_per_stage": 4,
           "warmup": 1 if args.quick else 2, "repeats": args.repeats or (3 if args.quick else 9)}
    iso_cfg = {"width": 1024, "rows": 128, "blocks": 4, "repeats": 5 if args.quick else 15}
    if args.smoke:
        cfg = {"ms": [6], "width": 16, "rows": 24, "blocks_per_stage": 1, "warmup": 1, "repeats": 1}
        iso_cfg = {"width": 16, "rows": 8, "blocks": 1, "repeats": 1}
        args.stages = [3]
    t0 = time.perf_counter()
    load = round(os.getloadavg()[0], 2)
    costs = isolated_costs(**iso_cfg)
    isolated = {"config": iso_cfg, "costs_s_measured": {k: round(v, 5) for k, v in costs.items()},
                "split_over_full_backward": round((costs["B"] + costs["W"]) / costs["full"], 3),
                "replays": [modelled_zbh1(costs, p, m) for p in (2, 4) for m in cfg["ms"]]}
    warm_workers("torch.distributed.pipelining")
    results = [] if args.isolated_only else [row for p in args.stages for row in measure(p, cfg)]
    doc: dict[str, Any] = {
        "benchmark": "pipeline_schedules",
        "peer": "torch.distributed.pipelining Schedule1F1B / ScheduleInterleaved1F1B / "
                "ScheduleInterleavedZeroBubble, same split, same processes",
        "config": cfg, "backend": "gloo (CPU)", "cpu_cores": os.cpu_count(),
        "load_average_1m_at_start": load,
        "timing": "medians over repeats; a step's time is the slowest rank's",
        "allocator": "paratrain's worker default (training/allocator.py: glibc keeps freed memory) "
                     "in every process, so torch's steps, in the same processes, have it too",
        "results": results,
        "isolated_stage": isolated,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    doc["provenance"] = provenance(doc, modelled=(
        "bubble_theory_modelled", "bubble_replay_modelled", "replay_makespan_s_modelled",
        "zbh1_replay_over_1f1b_replay_modelled"),
        configured=("stages", "micro_batches", "cores_per_stage", "torch_schedule", "cpu_cores"),
        mixed=("bubble_over_theory",))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
