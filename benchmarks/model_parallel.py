"""ModelParallel pipeline benchmark: paratrain's GPipe/1F1B vs torch.distributed.pipelining.

For p in {2, 4} stages and m = 8 micro-batches, on real gloo ranks (CPU), with the same
model and the same batch, in the same processes and interleaved step by step:

- ``step_ratio``: median step time of paratrain / of torch's ``ScheduleGPipe`` or
  ``Schedule1F1B`` (goal <= 1.1);
- ``bubble``: the measured bubble fraction ``1 - m (t_f + t_b) / step`` of GPipe's and
  Megatron's analysis, with ``m (t_f + t_b)`` the busiest stage's compute time in that
  step (busy = time in forward/backward compute), vs the theory ``(p - 1) / (m + p - 1)``
  (goal ratio <= 1.2), and vs torch's bubble measured the same way (forward/backward
  hooks on its stage module, in a separate metered pass), which shares the machine's noise. Also reported: the idle
  fraction averaged over stages, which also counts the lighter stages' waiting (load
  imbalance, including a process that happens to run slower on a shared machine);
- ``bubble_replay``: the same schedule replayed with this step's measured action times
  and free communication. The theory assumes equal, constant stage times; the replay
  keeps the real ones (stage imbalance, a compute time that varies with what the other
  process does), so ``measured / replay`` is what the runtime itself adds;
- ``peak_activation_bytes``: per stage, bytes held for backward (saved tensors + stage
  inputs/outputs) under 1F1B and GPipe, and their ratio (theory ``min(p - s, m) / m``);
  torch's peak saved-tensor bytes per stage, metered live with the same pack hook.

Like for like: torch's timed steps run with nothing of ours attached (no forward/backward
hooks, no saved-tensor hooks). Its compute clock and memory meter run afterwards in a
separate metered pass, whose steps give torch's bubble and peak but not its step time.
paratrain's own step timing and activation accounting are part of its runtime and stay on.

The model is a token MLP, ``Embedding(V, w)`` then ``2p`` blocks ``Linear(w, w) + ReLU``
then ``Linear(w, 10)``, split into equal runs of blocks (the embedding joins the first
stage, the head the last). The embedding matters: without it the first stage's input
needs no gradient and its backward skips a third of its work, an imbalance that no
schedule can hide and that the theory does not model.

The bubble goal assumes one core per stage: with p = 4 on a 2-core machine the stages
time-share the cores, so the measured bubble there is bounded by the machine, not by the
schedule (``cores_per_stage`` is reported).

Steps are separated by a barrier; a step's time is the slowest rank's. Prints one JSON
object. ``--quick`` runs fewer repeats on a smaller model; ``--smoke`` one repeat of a tiny
model on 3 stages (every code path, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paratrain.comm.p2p import P2PTransport  # noqa: E402
from paratrain.comm.testing import run_distributed  # noqa: E402
from paratrain.config.strategy import Partition  # noqa: E402
from paratrain.executors.model_parallel.plan import build_plan  # noqa: E402
from paratrain.executors.model_parallel.runtime import StageRuntime, segment_modules  # noqa: E402
from paratrain.executors.model_parallel.schedule import schedule, simulate, theoretical_bubble  # noqa: E402
from paratrain.training.gcfreeze import freeze_startup_objects  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance, warm_workers  # noqa: E402


def nodes(model: nn.Module) -> list[str]:
    """The Sequential's layers in order (its fx graph's call_module ids)."""
    return [name for name, _ in model.named_children()]


def build(width: int, blocks: int, classes: int = 10, vocab: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["embed"] = nn.Embedding(vocab, width)
    for i in range(blocks):
        layers[f"fc{i}"] = nn.Linear(width, width)
        layers[f"act{i}"] = nn.ReLU()
    layers["head"] = nn.Linear(width, classes)
    return nn.Sequential(layers)


def split(model: nn.Sequential, p: int) -> list[list[str]]:
    """Equal numbers of blocks per stage; the embedding joins the first, the head the last."""
    names = nodes(model)
    body = names[1:-1]
    per = len(body) // (2 * p)
    out = []
    for s in range(p):
        lo, hi = 2 * s * per, 2 * (s + 1) * per
        out.append((["embed"] if s == 0 else []) + body[lo:hi] + (["head"] if s == p - 1 else []))
    return out


class LiveSavedBytes:
    """Peak bytes of distinct non-parameter storages alive in autograd's saved tensors."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if ptr in self.exclude:
            return t
        if self.refs.get(ptr, 0) == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        weakref.finalize(t, self._release, ptr, nbytes)
        return t

    def _release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.live -= nbytes


class ComputeClock:
    """Wall time a module spends in forward and backward (hooks), for torch's stages."""

    def __init__(self, mod: nn.Module) -> None:
        self.total = 0.0
        self._t0 = 0.0
        self._mod = mod
        self._handles: list[Any] = []

    def attach(self) -> None:
        m = self._mod
        self._handles = [m.register_forward_pre_hook(self._start), m.register_forward_hook(self._stop),
                         m.register_full_backward_pre_hook(self._start),
                         m.register_full_backward_hook(self._stop)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _start(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._t0


def worker(ctx: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    freeze_startup_objects()  # as paratrain's worker entry does, for both implementations
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    p, m, width, rows = ctx.world_size, cfg["m"], cfg["width"], cfg["rows"]
    model = build(width, cfg["blocks"])
    stages = split(model, p)
    parts = [Partition.model_validate({"node_ids": ns, "target": {"WorkerId": f"worker-{s}"}})
             for s, ns in enumerate(stages) if s > 0]
    plan = build_plan(model, parts, ctx.workers, contiguous=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (rows,), generator=g)
    y = torch.randint(0, 10, (rows,), generator=g)

    transport = P2PTransport(ctx.group)
    ours_rt = StageRuntime(plan, ctx.rank, segment_modules(model, plan, ctx.rank), transport)
    ref_model = build(width, cfg["blocks"])
    sub = nn.Sequential(*[ref_model.get_submodule(n) for n in stages[ctx.rank]])
    clock = ComputeClock(sub)
    stage = PipelineStage(sub, ctx.rank, p, torch.device("cpu"))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, target)

    out: dict[str, Any] = {}
    for sched in ("GPipe", "1F1B"):
        torch_sched = (ScheduleGPipe if sched == "GPipe" else Schedule1F1B)(stage, m, loss_fn=loss_fn)
        ours_t: list[float] = []
        torch_t: list[float] = []
        busy: list[float] = []
        torch_busy: list[float] = []
        waits: list[float] = []
        costs: list[dict[tuple[str, int, int], float]] = []
        torch_metered_t: list[float] = []
        peak = 0
        torch_peak = 0
        params = {q.untyped_storage().data_ptr() for q in sub.parameters()}

        def torch_step(torch_sched: Any = torch_sched) -> None:
            if ctx.rank == 0:
                torch_sched.step(x)
            elif ctx.rank == p - 1:
                torch_sched.step(target=y)
            else:
                torch_sched.step()

        # Timed pass: both implementations interleaved step by step, alternating which
        # goes first; torch's stage has no hook or meter of ours attached.
        for rep in range(cfg["warmup"] + cfg["repeats"]):
            order = ("ours", "torch") if rep % 2 == 0 else ("torch", "ours")
            for impl in order:
                for mod in (ours_rt.modules.values() if impl == "ours" else [sub]):
                    mod.zero_grad(set_to_none=True)
                dist.barrier()
                w0 = transport.wait_s
                t0 = time.perf_counter()
                if impl == "ours":
                    ours_rt.train_step(x, y, step=rep, micro_batch_size=rows // m, schedule_name=sched)
                else:
                    torch_step()
                dt = time.perf_counter() - t0
                if rep >= cfg["warmup"]:
                    (ours_t if impl == "ours" else torch_t).append(dt)
                    if impl == "ours":
                        busy.append(ours_rt.stats.compute_s)
                        waits.append(transport.wait_s - w0)
                        peak = max(peak, ours_rt.stats.peak_activation_bytes)
                        costs.append({(k, i, sg): b - a for k, i, sg, a, b in ours_rt.stats.trace})
        # Metered pass (not timed against ours): torch's compute clock and saved-tensor meter.
        clock.attach()
        try:
            for _ in range(cfg["metered"]):
                sub.zero_grad(set_to_none=True)
                dist.barrier()
                clock.total = 0.0
                meter = LiveSavedBytes(params)
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
                    torch_step()
                torch_metered_t.append(time.perf_counter() - t0)
                torch_busy.append(clock.total)
                torch_peak = max(torch_peak, meter.peak)
        finally:
            clock.detach()
        out[sched] = {"ours": ours_t, "torch": torch_t, "busy": busy, "torch_busy": torch_busy,
                      "torch_metered": torch_metered_t, "wait": waits, "peak": peak,
                      "costs": costs, "torch_peak": torch_peak}
    return out


def measure(p: int, cfg: dict[str, Any]) -> dict[str, Any]:
    per_rank = run_distributed(worker, p, dict(cfg, blocks=cfg["blocks_per_stage"] * p), timeout_s=600)
    res: dict[str, Any] = {"stages": p, "micro_batches": cfg["m"],
                           "cores_per_stage": round((os.cpu_count() or 1) / p, 2),
                           "bubble_theory_modelled": round(theoretical_bubble(p, cfg["m"]), 4)}
    for sched in ("GPipe", "1F1B"):
        n = len(per_rank[0][sched]["ours"])
        ours = [max(r[sched]["ours"][i] for r in per_rank) for i in range(n)]
        ref = [max(r[sched]["torch"][i] for r in per_rank) for i in range(n)]
        metered = [max(r[sched]["torch_metered"][i] for r in per_rank)
                   for i in range(len(per_rank[0][sched]["torch_metered"]))]
        def bubbles(key: str, step: list[float], sched: str = sched) -> tuple[list[float], list[float]]:
            """Per step: the bottleneck stage's idle fraction, and the mean over stages."""
            busy = [[r[sched][key][i] for r in per_rank] for i in range(len(step))]
            return ([1 - max(b) / t for b, t in zip(busy, step, strict=True)],
                    [statistics.mean(1 - x / t for x in b) for b, t in zip(busy, step, strict=True)])

        bottleneck, mean_idle = bubbles("busy", ours)
        torch_bottleneck, torch_mean_idle = bubbles("torch_busy", metered)
        bubble = statistics.median(bottleneck)
        torch_bubble = statistics.median(torch_bottleneck)
        waited = statistics.median(
            statistics.mean(r[sched]["wait"][i] / ours[i] for r in per_rank) for i in range(n))
        orders = [schedule(sched, s, p, cfg["m"]) for s in range(p)]
        replays = [simulate(orders, costs={a: c for r in per_rank for a, c in r[sched]["costs"][i].items()}).bubble
                   for i in range(n)]
        # Per step: what the runtime (communication, bookkeeping) adds to the replayed schedule.
        overhead = statistics.median(b / r for b, r in zip(mean_idle, replays, strict=True))
        theory = res["bubble_theory_modelled"]
        res[sched] = {
            "step_s_median": round(statistics.median(ours), 5),
            "torch_step_s_median": round(statistics.median(ref), 5),
            "step_ratio_vs_torch": round(statistics.median(ours) / statistics.median(ref), 3),
            "bubble_measured": round(bubble, 4),
            "bubble_ratio_vs_theory": round(bubble / theory, 3),
            "bubble_mean_over_stages": round(statistics.median(mean_idle), 4),
            "bubble_mean_over_stages_ratio_vs_theory": round(statistics.median(mean_idle) / theory, 3),
            "bubble_replay_modelled": round(statistics.median(replays), 4),
            "bubble_mean_over_stages_ratio_vs_replay": round(overhead, 3),
            "bubble_part_blocked_in_recv": round(waited, 4),
            "torch_bubble_measured": round(torch_bubble, 4),
            "torch_bubble_mean_over_stages": round(statistics.median(torch_mean_idle), 4),
            "bubble_ratio_vs_torch": round(bubble / torch_bubble, 3) if torch_bubble > 0 else None,
            "peak_activation_bytes_per_stage": [r[sched]["peak"] for r in per_rank],
            "torch_peak_saved_bytes_per_stage": [r[sched]["torch_peak"] for r in per_rank],
        }
    res["peak_activation_ratio_1f1b_over_gpipe"] = [
        round(a / b, 3) for a, b in zip(res["1F1B"]["peak_activation_bytes_per_stage"],
                                        res["GPipe"]["peak_activation_bytes_per_stage"], strict=True)]
    res["peak_activation_ratio_theory"] = [round(min(p - s, cfg["m"]) / cfg["m"], 3) for s in range(p)]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller model")
    ap.add_argument("--smoke", action="store_true",
                    help="3 stages (a first, a middle and a last), width 16, 1 repeat: every code path")
    args = ap.parse_args()
    cfg = {"m": 8, "width": 256 if args.quick else 1024, "rows": 128 if args.quick else 1024,
           "blocks_per_stage": 2 if args.quick else 4, "warmup": 1 if args.quick else 3,
           "repeats": 3 if args.quick else 21, "metered": 3 if args.quick else 7}
    sizes = (2, 4)
    if args.smoke:
        cfg = {"m": 4, "width": 16, "rows": 16, "blocks_per_stage": 1, "warmup": 1, "repeats": 1, "metered": 1}
        sizes = (3,)
    t0 = time.perf_counter()
    load = round(os.getloadavg()[0], 2)
    warm_workers("torch.distributed.pipelining")
    results = [measure(p, cfg) for p in sizes]
    doc: dict[str, Any] = {
        "benchmark": "model_parallel_pipeline",
        "peer": "torch.distributed.pipelining ScheduleGPipe/Schedule1F1B, same split, same processes",
        "config": cfg,
        "backend": "gloo (CPU)",
        "cpu_cores": os.cpu_count(),
        "load_average_1m_at_start": load,
        "note": "one single-threaded process per stage; with more stages than idle cores, "
                "stages time-share cores, which inflates measured bubbles",
        "timing": "medians over repeats; a step's time is the slowest rank's; torch's step time "
                  "comes from the timed pass with nothing attached, its bubble and peak memory "
                  "from the separate metered pass",
        "results": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    doc["provenance"] = provenance(doc, modelled=("bubble_replay_modelled", "peak_activation_ratio_theory"),
                                   configured=("stages", "micro_batches", "cores_per_stage", "cpu_cores"),
                                   mixed=("bubble_ratio_vs_theory", "bubble_mean_over_stages_ratio_vs_theory",
                                          "bubble_mean_over_stages_ratio_vs_replay"))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
