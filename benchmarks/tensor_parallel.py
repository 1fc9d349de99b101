"""Tensor parallelism benchmark: paratrain's layers vs torch's tensor-parallel styles.

On 2 real gloo ranks, for a 4-layer MLP (hidden 1024) and a transformer block (pre-norm,
q/k/v/o attention + 4x MLP), built from the same weights:

- step time (forward + backward) of ``paratrain.tensor_parallel.parallelize`` at its
  *default* configuration (``memory_optimization = "Medium"``: the forward is recomputed
  in backward, its collectives' outputs read back, not re-run) vs ``torch.distributed.tensor.
  parallel`` at its documented default (``parallelize_module`` with ColwiseParallel /
  RowwiseParallel, no recomputation: ``step_time_ratio_vs_torch_default``, goal <= 1.0) and
  in its best form (plus, on the attention module, ``PrepareModuleInput``: the input
  becomes one replicated DTensor, so the q/k/v input gradients meet in one all-reduce
  instead of three: ``step_time_ratio_vs_torch``). Paired repeats, the order rotated each
  repeat; each ratio is the median over repeats of (ours / torch's) in the same repeat.
  Also timed: ``memory_optimization = "None"`` and the default under the policy before the
  collective tape (``recompute_collectives = True``: the recomputation re-ran the forward
  all-reduces), with their collectives per step;
- bytes per step: the payload this rank hands to the collectives (measured at each call)
  and what it sends under the ring cost model (modelled), vs the Megatron minimum
  (modelled): one all-reduce of the row output forward per column/row pair, one of the
  column input gradient backward when that input needs a gradient (goal 1.0 without
  recomputation), for every communication pattern;
- collectives per step, ours and torch's (CommDebugMode);
- per-rank parameter memory vs the dense model (goal 1/tp plus the replicated parts).

``python benchmarks/tensor_parallel.py [--quick | --smoke] [--cuda]`` prints one JSON object
(``--smoke``: tiny models, one repeat: every code path in seconds).
``--cuda`` (when CUDA is available) also runs the parity and bf16 checks on the GPU in one
process (the parallel layers on a size-1 group, real device allocator peaks for the memory
levels); ``device_checks("cpu")`` runs the same code on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed
from paratrain.config import TensorParallelismConfig
from paratrain.tensor_parallel import SelfAttention, parallelize

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import provenance, warm_workers  # noqa: E402

PATTERNS = ["AllReduce", "AllGather", "ReduceScatter", "PointToPoint", "Hierarchical"]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1 x); x + mlp(ln2 x)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, 4 * dim), act=nn.GELU(),
                                             fc2=nn.Linear(4 * dim, dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def torch_default_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The same layout in torch's documented default form: ColwiseParallel / RowwiseParallel
    only (no PrepareModuleInput)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {k: v for k, v in plan.items() if isinstance(v, ColwiseParallel | RowwiseParallel)}


def _paired(ours: list[float], ref: list[float]) -> float:
    """Median over repeats of ours / ref timed in the same repeat."""
    return statistics.median(a / b for a, b in zip(ours, ref, strict=True))


def dims(size: str) -> dict[str, int]:
    """The models' sizes: ``full``, ``quick`` (smaller batches) or ``smoke`` (tiny: every
    code path in seconds)."""
    if size == "smoke":
        return {"h": 64, "b": 4, "dim": 32, "heads": 4, "bsz": 2, "seq": 8, "deep": 2, "reps": 1}
    quick = size == "quick"
    return {"h": 1024, "b": 32 if quick else 64, "dim": 256, "heads": 8, "bsz": 4 if quick else 8,
            "seq": 64, "deep": 8, "reps": 5 if quick else 15}


def build(kind: str, size: str) -> tuple[nn.Module, torch.Tensor, dict[str, Any], int]:
    """(dense model, input, torch TP plan, Megatron-minimum bytes per step at p=2)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        h, b = dims(size)["h"], dims(size)["b"]
        model = nn.Sequential(OrderedDict(
            fc0=nn.Linear(h, h), act0=nn.GELU(), fc1=nn.Linear(h, h), act1=nn.GELU(),
            fc2=nn.Linear(h, h), act2=nn.GELU(), fc3=nn.Linear(h, h)))
        x = torch.randn(b, h, generator=g)
        plan: dict[str, Any] = {"fc0": ColwiseParallel(), "fc1": RowwiseParallel(),
                                "fc2": ColwiseParallel(), "fc3": RowwiseParallel()}
        n = b * h * 4
        minimum = 3 * n  # fwd 2 all-reduces, bwd 1 (fc0's input is data), x 2(p-1)/p = 1
        return nn.Sequential(OrderedDict(net=model)), x, {f"net.{k}": v for k, v in plan.items()}, minimum
    dim, heads, bsz, seq = (dims(size)[k] for k in ("dim", "heads", "bsz", "seq"))
    model = nn.Sequential(OrderedDict(block=Block(dim, heads)))
    x = torch.randn(bsz, seq, dim, generator=g)
    # PrepareModuleInput: q, k and v read one replicated DTensor, so their three partial
    # input gradients add up locally and meet in a single all-reduce (torch's best form)
    plan = {"block.attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                             desired_input_layouts=(Replicate(),),
                                             use_local_output=False),
            "block.attn.q": ColwiseParallel(), "block.attn.k": ColwiseParallel(),
            "block.attn.v": ColwiseParallel(), "block.attn.o": RowwiseParallel(),
            "block.mlp.fc1": ColwiseParallel(), "block.mlp.fc2": RowwiseParallel()}
    n = bsz * seq * dim * 4
    return model, x, plan, 4 * n  # fwd: attn + mlp outputs; bwd: attn and mlp input grads


def _timeit(fn: Any, reps: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def worker(ctx: WorkerContext, size: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    reps = dims(size)["reps"]
    tp = ctx.world_size
    mesh = init_device_mesh("cpu", (tp,))
    res: dict[str, Any] = {}
    for kind in ["mlp", "transformer"]:
        dense, x, plan, minimum = build(kind, size)
        ours = parallelize(copy.deepcopy(dense), TensorParallelismConfig(tensor_parallel_size=tp))
        ours_none = parallelize(copy.deepcopy(dense), TensorParallelismConfig(
            tensor_parallel_size=tp, memory_optimization="None"))
        ours_old = parallelize(copy.deepcopy(dense), TensorParallelismConfig(tensor_parallel_size=tp))
        ours_old.recompute_collectives = True  # the policy before the tape
        ref = copy.deepcopy(dense)
        parallelize_module(ref, mesh, plan)
        ref_default = copy.deepcopy(dense)
        parallelize_module(ref_default, mesh, torch_default_plan(plan))
        if kind == "transformer":
            ref.block.attn.num_heads = dense.block.attn.num_heads // tp
            ref_default.block.attn.num_heads = dense.block.attn.num_heads // tp

        def step(m: nn.Module, x: torch.Tensor = x) -> None:
            m(x).square().mean().backward()
            m.zero_grad(set_to_none=True)

        with torch.no_grad():  # same function: ours (default config) vs torch's plan
            out_diff = float((ours(x) - ref(x)).abs().max())
        for _ in range(2):  # warm-up
            for m in (ours, ours_none, ours_old, ref, ref_default):
                step(m)
        t_ours: list[float] = []
        t_none: list[float] = []
        t_old: list[float] = []
        t_ref: list[float] = []
        t_refd: list[float] = []
        for r in range(reps):  # paired repeats, rotating the order
            group = [(ours, t_ours), (ours_none, t_none), (ours_old, t_old), (ref, t_ref),
                     (ref_default, t_refd)]
            k = r % len(group)
            for m, acc in group[k:] + group[:k]:
                acc += _timeit(lambda m=m: step(m), 1)
        ours_old.stats.reset()
        step(ours_old)
        st_old = ours_old.statistics()
        ours_old.comm.close()
        ours_none.stats.reset()
        step(ours_none)
        st_none = ours_none.statistics()
        ours_none.comm.close()
        ours.stats.reset()
        step(ours)
        st = ours.statistics()
        torch_counts = _torch_counts(ref, step)
        torch_default_counts = _torch_counts(ref_default, step)
        dense_t = []
        if ctx.rank == 0:
            d = copy.deepcopy(dense)
            for _ in range(reps):
                t0 = time.perf_counter()
                step(d)
                dense_t.append(time.perf_counter() - t0)
        dist.barrier()
        patterns: dict[str, Any] = {}
        for p in PATTERNS:
            m = parallelize(copy.deepcopy(dense), TensorParallelismConfig(
                tensor_parallel_size=tp, communication_pattern=p, memory_optimization="None"))
            step(m)
            ts = _timeit(lambda m=m: step(m), max(min(3, reps), reps // 3))
            m.stats.reset()
            step(m)
            s = m.statistics()
            patterns[p] = {"step_s": statistics.median(ts),
                           "bytes_sent_per_step_modelled": s["bytes_sent_modelled"],
                           "payload_bytes_per_step_measured": s["payload_bytes_measured"],
                           "bytes_vs_megatron_min": s["bytes_sent_modelled"] / minimum,
                           "collectives": s["collectives"]}
            m.comm.close()
        ablations = _ablations(dense, x, tp, reps, step, size) if kind == "transformer" else {}
        med_o, med_r = statistics.median(t_ours), statistics.median(t_ref)
        med_n = statistics.median(t_none)
        res[kind] = {
            "paratrain_config": "default (memory_optimization Medium)",
            "step_s_paratrain": med_o,
            "step_s_paratrain_no_recompute": med_n,
            "step_s_paratrain_old_policy": statistics.median(t_old),
            "step_s_torch_tp": med_r,
            "step_s_torch_tp_default": statistics.median(t_refd),
            "step_time_ratio_vs_torch_default": _paired(t_ours, t_refd),
            "step_time_ratio_vs_torch": _paired(t_ours, t_ref),
            "step_time_ratio_vs_torch_no_recompute": _paired(t_none, t_ref),
            "step_time_ratio_vs_torch_default_old_policy": _paired(t_old, t_refd),
            "collectives_per_step_paratrain": st["total_collectives"],
            "collectives_per_step_paratrain_no_recompute": st_none["total_collectives"],
            "collectives_per_step_paratrain_old_policy": st_old["total_collectives"],
            "collectives_replayed_per_step_paratrain": st["replayed_collectives"],
            "collectives_per_step_torch_tp_default": _total(torch_default_counts),
            "collectives_per_step_torch_tp": _total(torch_counts),
            "step_s_dense_1proc": statistics.median(dense_t) if dense_t else None,
            "output_max_abs_diff_vs_torch": out_diff,
            "bytes_sent_per_step_modelled": st["bytes_sent_modelled"],
            "payload_bytes_per_step_measured": st["payload_bytes_measured"],
            "megatron_min_bytes_modelled": minimum,
            "bytes_vs_megatron_min": st["bytes_sent_modelled"] / minimum,
            "payload_vs_megatron_min": st["payload_bytes_measured"] / minimum,
            "bytes_vs_megatron_min_no_recompute": st_none["bytes_sent_modelled"] / minimum,
            "collectives_paratrain": st["collectives"],
            "collectives_paratrain_no_recompute": st_none["collectives"],
            "collectives_torch_tp": torch_counts,
            "collectives_torch_tp_default": torch_default_counts,
            "param_memory_fraction": st["param_memory_fraction"],
            "param_memory_ideal_fraction": st["param_memory_ideal_fraction"],
            "param_memory_vs_ideal": st["param_memory_fraction"] / st["param_memory_ideal_fraction"],
            "patterns": patterns,
        }
        if ablations:
            res[kind]["ablations"] = ablations
    return res


def _torch_counts(m: nn.Module, step: Any) -> dict[str, int]:
    """torch's collectives in one step, by kind (CommDebugMode)."""
    try:
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as cdm:
            step(m)
        return {str(k).split(".")[-1]: int(v) for k, v in cdm.get_comm_counts().items()}
    except Exception as e:  # noqa: BLE001 - reporting only
        return {"error": str(e)[:80]}  # type: ignore[dict-item]


def _total(counts: dict[str, int]) -> int | None:
    return None if "error" in counts else sum(counts.values())


def _ablations(dense: nn.Module, x: torch.Tensor, tp: int, reps: int, step: Any, size: str) -> dict[str, Any]:
    """What each switch does on the transformer block, measured in the same run."""
    base = {"tensor_parallel_size": tp, "memory_optimization": "None"}
    variants: dict[str, dict[str, Any]] = {
        "default": {}, "async_off": {"async_communication": False},
        "fusion_off": {"fusion_threshold_bytes": 0}, "mixed_precision": {"mixed_precision": True},
    }
    out: dict[str, Any] = {}
    for name, extra in variants.items():
        m = parallelize(copy.deepcopy(dense), TensorParallelismConfig(**{**base, **extra}))
        step(m)
        ts = _timeit(lambda m=m: step(m), reps)
        m.stats.reset()
        step(m)
        st = m.statistics()
        out[name] = {"step_s": statistics.median(ts), "collectives": st["total_collectives"],
                     "async_collectives": st["async_collectives"],
                     "bytes_sent_modelled": st["bytes_sent_modelled"]}
    for name in variants:
        out[name]["step_time_vs_default"] = out[name]["step_s"] / out["default"]["step_s"]
    d = dims(size)
    deep = nn.Sequential(*[Block(d["dim"], d["heads"]) for _ in range(d["deep"])])
    levels: dict[str, Any] = {}
    for level in ["None", "Low", "Medium", "High", "Extreme"]:
        m = parallelize(copy.deepcopy(deep), TensorParallelismConfig(
            tensor_parallel_size=tp, memory_optimization=level))
        step(m)
        ts = _timeit(lambda m=m: step(m), max(min(3, reps), reps // 3))
        with m.measure_activations() as meter:
            step(m)
        levels[level] = {"step_s": statistics.median(ts), "peak_activation_bytes": meter.peak}
    for v in levels.values():
        v["peak_vs_none"] = v["peak_activation_bytes"] / levels["None"]["peak_activation_bytes"]
        v["step_time_vs_none"] = v["step_s"] / levels["None"]["step_s"]
    out["memory_optimization_8_blocks"] = levels
    return out


def device_checks(device: str, size: str = "quick") -> dict[str, Any]:
    """One process on ``device``: the parallel layers (size-1 group, same autograd functions)
    vs the dense block, bf16 vs fp32, and peak memory per memory_optimization level
    (the device allocator's peak on CUDA, the saved-activation meter elsewhere)."""
    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.tensor_parallel.converter import Converter
    from paratrain.tensor_parallel.layers import RegionState

    dev = torch.device(device)
    model, x, _, _ = build("transformer", size)
    model, x = model.to(dev), x.to(dev)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else device}
    xr = x.clone().requires_grad_(True)
    ref = model(xr)
    ref.square().mean().backward()
    for mp in (False, True):
        state = RegionState(compute_dtype=torch.bfloat16 if mp else None)
        conv = Converter(TensorParallelismConfig(mixed_precision=mp), TPComm(None, [0], rank=0), state)
        m = conv.convert(copy.deepcopy(model))
        xt = x.clone().requires_grad_(True)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=mp):
            y = m(xt)
        y = y.float()
        y.square().mean().backward()
        y = y.detach()
        assert xt.grad is not None and xr.grad is not None
        key = "bf16" if mp else "fp32"
        out[f"{key}_out_rel_err"] = float((y.float() - ref).abs().max() / ref.abs().max())
        out[f"{key}_xgrad_rel_err"] = float((xt.grad - xr.grad).abs().max() / xr.grad.abs().max())
        out[f"{key}_layers_converted"] = conv.units
    peaks = {}
    d = dims(size)
    deep = nn.Sequential(*[Block(d["dim"], d["heads"]) for _ in range(d["deep"])]).to(dev)
    for level in ["None", "Low", "Medium", "High", "Extreme"]:
        m = parallelize(copy.deepcopy(deep), TensorParallelismConfig(memory_optimization=level),
                        build_tp_groups(1))
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            m(x).square().mean().backward()
            torch.cuda.synchronize()
            peaks[level] = torch.cuda.max_memory_allocated() - base
        else:
            with m.measure_activations() as meter:
                m(x).square().mean().backward()
            peaks[level] = meter.peak
    out["peak_bytes_by_level"] = peaks
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 repeat: every code path")
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    warm_workers("torch.distributed.tensor.parallel")
    res = run_distributed(worker, 2, size, timeout_s=600)[0]
    report: dict[str, Any] = {
        "benchmark": "tensor_parallel",
        "world_size": 2,
        "size": size,
        "peer": "torch.distributed.tensor.parallel parallelize_module: ColwiseParallel/RowwiseParallel "
                "(its documented default) and the same + PrepareModuleInput on attention (its best "
                "form), same weights, same run",
        "timing": "paired repeats, order rotated each repeat; ratios are medians of per-repeat ratios",
        "goals": {"step_time_ratio_vs_torch_default": "<= 1.0", "step_time_ratio_vs_torch": "<= 1.1",
                  "collectives_per_step_paratrain": "== collectives_per_step_paratrain_no_recompute",
                  "bytes_vs_megatron_min": "1.0", "param_memory_vs_ideal": "1.0"},
        "results": res,
    }
    checks = "smoke" if args.smoke else "quick"  # the device checks' models: the quick ones at most
    report["device_checks"] = {"cpu": device_checks("cpu", checks)}
    if args.cuda:
        report["device_checks"]["cuda"] = (device_checks("cuda", checks) if torch.cuda.is_available()
                                           else "CUDA not available")
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["provenance"] = provenance(report, modelled=(
        "megatron_min_bytes_modelled", "bytes_vs_megatron_min", "bytes_vs_megatron_min_no_recompute",
        "param_memory_ideal_fraction"),
        mixed=("payload_vs_megatron_min", "param_memory_vs_ideal"), configured=("world_size",))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
