"""Worker functions for the tensor-parallel multi-process tests (run on real gloo ranks).

Each ``suite_*`` runs many checks in one process group (spawning ranks is the slow part)
and returns plain numbers; the tests assert on them.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.comm.tp.comm import CommStats
from paratrain.comm.tp.groups import build_tp_groups
from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.tensor_parallel import SelfAttention, TensorParallelModule, parallelize

PATTERNS = ["AllReduce", "AllGather", "ReduceScatter", "PointToPoint", "Hierarchical"]
_GROUPS: dict[tuple[int, str], Any] = {}


def _par(model: nn.Module, conf: TensorParallelismConfig) -> TensorParallelModule:
    """parallelize with the TP groups of this world built once per pattern (creating gloo
    groups is the slow part of these suites), fresh statistics and this config's switches."""
    tp = conf.tensor_parallel_size
    if not dist.is_initialized() or tp != dist.get_world_size():
        return parallelize(model, conf)
    key = (tp, conf.communication_pattern.value)
    if key not in _GROUPS:
        _GROUPS[key] = build_tp_groups(tp, pattern=key[1])
    groups = _GROUPS[key]
    groups.tp.stats = CommStats()
    groups.tp.async_op = conf.async_communication
    groups.tp.fusion_threshold_bytes = conf.fusion_threshold_bytes
    return parallelize(model, conf, groups)


class CrossEntropyTask:
    """The loss of a classification task (all the engine's step needs of a Task)."""

    @staticmethod
    def loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])


def engine_step(tpm: TensorParallelModule, x: torch.Tensor, y: torch.Tensor,
                opt: torch.optim.Optimizer, *, micro_batches: int) -> float:
    """One optimizer step of (x, y) the way a tensor-parallel job takes it: the one loop's
    Trainer over the executor's TensorParallelEngine (micro-batches, gradient sync)."""
    from paratrain.config.job import TrainConfig
    from paratrain.executors.tensor_parallel.engine import TensorParallelEngine
    from paratrain.training.loop import Trainer

    engine = TensorParallelEngine(tpm, CrossEntropyTask(), None, device=torch.device("cpu"),
                                  micro_batches=micro_batches)
    return Trainer(engine, opt, TrainConfig(), total_steps=1).step([(x, y)])


def dense_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("mlp", "mlp1"):  # uneven hidden (30) so tp=4 shards are 8,8,8,6
        return nn.Sequential(OrderedDict(fc0=nn.Linear(16, 30), act0=nn.GELU(), fc1=nn.Linear(30, 12)))
    if kind == "mlp_down":  # contracting first layer: Dynamic picks row-first
        return nn.Sequential(OrderedDict(fc0=nn.Linear(16, 8), act0=nn.GELU(), fc1=nn.Linear(8, 12)))
    if kind == "mlp_even":  # DTensor's Colwise output assumes even shards
        return nn.Sequential(OrderedDict(fc0=nn.Linear(16, 32), act0=nn.GELU(), fc1=nn.Linear(32, 12)))
    if kind == "attn":
        return nn.Sequential(OrderedDict(attn=SelfAttention(16, 4), act=nn.Tanh(), out=nn.Linear(16, 5)))
    if kind == "encoder":
        return nn.Sequential(OrderedDict(
            embed=nn.Linear(8, 16),
            block0=nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
            block1=nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True,
                                              norm_first=True),
            head=nn.Linear(16, 3)))
    if kind == "deep":  # 8 blocks for the checkpointing levels
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(8):
            layers[f"fc{2 * i}"] = nn.Linear(32, 128)
            layers[f"act{2 * i}"] = nn.GELU()
            layers[f"fc{2 * i + 1}"] = nn.Linear(128, 32)
        layers["head"] = nn.Linear(32, 4)
        return nn.Sequential(layers)
    raise ValueError(kind)


def model_input(kind: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = {"mlp": (7, 16), "mlp1": (1, 16), "mlp_even": (7, 16), "mlp_down": (7, 16), "attn": (3, 6, 16), "encoder": (2, 6, 8), "deep": (64, 32)}[kind]
    return torch.randn(*shape, generator=g)


def _weights(out: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randn(out.shape, generator=g)


def dense_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * _weights(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, x.grad


def tp_grads(tpm: TensorParallelModule, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = tpm(x)
    (out * _weights(out)).sum().backward()
    tpm.sync_gradients()
    grads = tpm.gather_full({n: p.grad if p.grad is not None else torch.zeros_like(p)
                             for n, p in tpm.module.named_parameters()})
    assert x.grad is not None
    return out.detach(), grads, x.grad


def _maxdiff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0 for k in a)


def parity(kind: str, pattern: str, tp: int, **cfg: Any) -> dict[str, float]:
    dense = dense_model(kind)
    x = model_input(kind)
    d_out, d_grads, d_x = dense_grads(copy.deepcopy(dense), x)
    conf = TensorParallelismConfig(tensor_parallel_size=tp, communication_pattern=pattern,
                                   memory_optimization=cfg.pop("memory_optimization", "None"), **cfg)
    tpm = _par(copy.deepcopy(dense), conf)
    t_out, t_grads, t_x = tp_grads(tpm, x)
    return {"out": float((d_out - t_out).abs().max()), "grads": _maxdiff(d_grads, t_grads),
            "xgrad": float((d_x - t_x).abs().max()),
            "scale": float(d_out.abs().max())}


def proportional_partitioner(name: str, shape: tuple[int, ...], tp: int, world: int) -> list[Any]:
    """Custom: rank r gets a share of the output features proportional to r + 1."""
    from paratrain.tensor_parallel import TensorPartition

    n = shape[-1]
    total = tp * (tp + 1) // 2
    sizes = [n * (r + 1) // total for r in range(tp)]
    sizes[-1] += n - sum(sizes)
    out, at = [], 0
    for r, w in enumerate(sizes):
        out.append(TensorPartition(r, r % world, name, (*shape[:-1], w), (0, at), True))
        at += w
    return out


def strategies(tp: int) -> dict[str, Any]:
    """partitioning_strategy changes the layout: parity and the collectives of each."""
    from paratrain.tensor_parallel import register_custom_partitioner

    register_custom_partitioner(proportional_partitioner)
    out: dict[str, Any] = {}
    cases = [("RowWise", "mlp"), ("Dynamic", "mlp_down"), ("Dynamic", "mlp"),
             ("BatchWise", "mlp"), ("SequenceWise", "mlp"), ("Custom", "mlp"),
             ("BatchWise", "encoder"), ("RowWise", "attn")]
    if tp == 4:  # BlockWise on a 2 x 2 grid: 7 rows (4 + 3), a 1-row batch (1 + 0), a
        # transformer (grid embed/head around head-split encoder layers), 8 deep blocks
        cases += [("BlockWise", "mlp"), ("BlockWise", "mlp1"), ("BlockWise", "encoder"),
                  ("BlockWise", "deep")]
    for strat, kind in cases:
        res = parity(kind, "AllReduce", tp, partitioning_strategy=strat)
        dense = dense_model(kind)
        x = model_input(kind).requires_grad_(True)
        tpm = _par(dense, TensorParallelismConfig(
            tensor_parallel_size=tp, partitioning_strategy=strat, memory_optimization="None"))
        tpm.stats.reset()
        y = tpm(x)
        res["fwd"] = tpm.statistics()["collectives"]
        res["local_shapes"] = {n: list(p.shape) for n, p in tpm.module.named_parameters()
                               if n.endswith("weight")}
        res["saving"] = tpm.statistics()["memory_saving"]
        y.sum().backward()
        out[f"{strat}/{kind}"] = res
    for col, row in [(True, False), (False, True)]:
        key = "column_only" if col else "row_only"
        res = parity("mlp", "AllReduce", tp, column_parallel=col, row_parallel=row)
        tpm = _par(dense_model("mlp"), TensorParallelismConfig(
            tensor_parallel_size=tp, column_parallel=col, row_parallel=row, memory_optimization="None"))
        tpm.stats.reset()
        tpm(model_input("mlp"))
        res["fwd"] = tpm.statistics()["collectives"]
        res["layers"] = [type(m).__name__ for m in tpm.module.children()]
        out[key] = res
    try:
        _par(dense_model("mlp"), TensorParallelismConfig(
            tensor_parallel_size=tp, column_parallel=False, row_parallel=False))
        out["neither"] = "ok"
    except ConfigError as e:
        out["neither"] = str(e)
    try:
        _par(dense_model("mlp"), TensorParallelismConfig(
            tensor_parallel_size=tp, partitioning_strategy="BlockWise", memory_optimization="None"))
        out["BlockWise"] = "ok"
    except ConfigError as e:
        out["BlockWise"] = str(e)
    return out


def wrong_variant(tp: int) -> float:
    """Non-vacuity: a row layer whose reduction is skipped must NOT match the dense model."""
    from paratrain.tensor_parallel.layers import RowParallelLinear

    dense = dense_model("mlp")
    x = model_input("mlp")
    d_out, _, _ = dense_grads(copy.deepcopy(dense), x)
    tpm = _par(copy.deepcopy(dense), TensorParallelismConfig(tensor_parallel_size=tp,
                                                                    memory_optimization="None"))
    row = tpm.module.fc1
    assert isinstance(row, RowParallelLinear)
    partial = nn.functional.linear(nn.functional.gelu(tpm.module.fc0(x)), row.weight, row.bias)
    return float((partial.detach() - d_out).abs().max())


def dtensor_parity(kind: str, tp: int) -> dict[str, float]:
    """Ours vs torch.distributed.tensor.parallel ColwiseParallel/RowwiseParallel, same weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dense = dense_model(kind)
    x = model_input(kind)
    mesh = init_device_mesh("cpu", (tp,))
    ref = copy.deepcopy(dense)
    if kind.startswith("mlp"):
        plan: dict[str, Any] = {"fc0": ColwiseParallel(), "fc1": RowwiseParallel()}
    else:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel()}
    parallelize_module(ref, mesh, plan)
    if kind == "attn":
        ref.attn.num_heads = dense.attn.num_heads // tp  # local heads, as torchtitan does
    xr = x.clone().requires_grad_(True)
    r_out = ref(xr)
    (r_out * _weights(r_out)).sum().backward()
    r_grads = {}
    for n, p in ref.named_parameters():
        g = p.grad
        assert g is not None
        r_grads[n] = g.full_tensor() if isinstance(g, DTensor) else g
    tpm = _par(copy.deepcopy(dense), TensorParallelismConfig(tensor_parallel_size=tp,
                                                                    memory_optimization="None"))
    t_out, t_grads, t_x = tp_grads(tpm, x)
    assert xr.grad is not None
    return {"out": float((r_out.detach() - t_out).abs().max()), "grads": _maxdiff(r_grads, t_grads),
            "xgrad": float((xr.grad - t_x).abs().max())}


def counts(pattern: str, tp: int, **cfg: Any) -> dict[str, Any]:
    """Collectives issued by one forward and one backward of the MLP block."""
    dense = dense_model("mlp")
    x = model_input("mlp").requires_grad_(True)
    tpm = _par(dense, TensorParallelismConfig(
        tensor_parallel_size=tp, communication_pattern=pattern, memory_optimization="None", **cfg))
    tpm.stats.reset()
    out = tpm(x)
    fwd = tpm.statistics()
    tpm.stats.reset()
    out.sum().backward()
    bwd = tpm.statistics()
    return {"fwd": fwd["collectives"], "bwd": bwd["collectives"], "fwd_bytes": fwd["bytes_sent_modelled"],
            "bwd_async": bwd["async_collectives"],
            "bwd_bytes": bwd["bytes_sent_modelled"], "out_bytes": out.numel() * 4,
            "fwd_payload": fwd["payload_bytes_measured"], "bwd_payload": bwd["payload_bytes_measured"],
            "x_bytes": x.numel() * 4}


def attn_fusion_counts(tp: int, threshold: int) -> dict[str, Any]:
    dense = dense_model("attn")
    x = model_input("attn").requires_grad_(True)
    tpm = _par(dense, TensorParallelismConfig(
        tensor_parallel_size=tp, fusion_threshold_bytes=threshold, memory_optimization="None"))
    out = tpm(x)
    tpm.stats.reset()
    out.sum().backward()
    return {"bwd": tpm.statistics()["collectives"], "xgrad": x.grad}


def mixed_precision(tp: int) -> dict[str, float]:
    dense = dense_model("encoder")
    x = model_input("encoder")
    res = {}
    for mp in (False, True):
        tpm = _par(copy.deepcopy(dense), TensorParallelismConfig(
            tensor_parallel_size=tp, mixed_precision=mp, memory_optimization="None"))
        out = tpm(x)
        loss = out.square().mean()
        loss.backward()
        res["loss_bf16" if mp else "loss_fp32"] = float(loss)
        res["bytes_bf16" if mp else "bytes_fp32"] = tpm.statistics()["bytes_sent_modelled"]
        res["master_dtype_bf16" if mp else "master_dtype_fp32"] = str(next(tpm.parameters()).dtype)
        res["grad_dtype_bf16" if mp else "grad_dtype_fp32"] = str(next(tpm.parameters()).grad.dtype)
    return res


def sequence_parallel_memory(tp: int) -> dict[str, int]:
    """Sequence parallelism keeps only the sequence shard of each column input."""
    dense = dense_model("deep")
    x = model_input("deep")
    peaks = {}
    for pattern in ("AllReduce", "ReduceScatter"):
        tpm = _par(copy.deepcopy(dense), TensorParallelismConfig(
            tensor_parallel_size=tp, communication_pattern=pattern, memory_optimization="None"))
        with tpm.measure_activations() as meter:
            tpm(x).square().mean().backward()
        peaks[pattern] = meter.peak
    return peaks


def memory_levels(tp: int) -> dict[str, Any]:
    dense = dense_model("deep")
    x = model_input("deep")
    peaks, outs, grads = {}, {}, {}
    for level in ["None", "Low", "Medium", "High", "Extreme"]:
        tpm = _par(copy.deepcopy(dense), TensorParallelismConfig(
            tensor_parallel_size=tp, memory_optimization=level))
        with tpm.measure_activations() as meter:
            out = tpm(x)
            out.square().mean().backward()
        peaks[level] = meter.peak
        outs[level] = out.detach()
        grads[level] = tpm.module.fc0.weight.grad.clone()
    return {"peaks": peaks,
            "out_diff": max(float((outs[k] - outs["None"]).abs().max()) for k in outs),
            "grad_diff": max(float((grads[k] - grads["None"]).abs().max()) for k in grads)}


def grad_accum(tp: int, accumulate: bool, pattern: str = "ReduceScatter") -> dict[str, Any]:
    dense = dense_model("mlp")
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(12, 16, generator=g), torch.randint(0, 12, (12,), generator=g)
    tpm = _par(copy.deepcopy(dense), TensorParallelismConfig(
        tensor_parallel_size=tp, communication_pattern=pattern, gradient_accumulation=accumulate,
        memory_optimization="None"))
    opt = torch.optim.SGD(tpm.parameters(), lr=0.5)
    tpm.stats.reset()
    loss = engine_step(tpm, x, y, opt, micro_batches=3)
    stats = tpm.statistics()
    # reference: dense full-batch SGD step
    ref = copy.deepcopy(dense)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rl = nn.functional.cross_entropy(ref(x), y)
    rl.backward()
    ropt.step()
    full = tpm.dense_state_dict()
    diff = max(float((full[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    return {"loss": loss, "ref_loss": float(rl), "param_diff": diff, "collectives": stats["collectives"]}


def two_d(ctx: WorkerContext, fusion: int) -> dict[str, Any]:
    """tp=2 x dp=2: each DP replica sees its half of the batch; after the step the model
    must equal a dense SGD step on the whole batch."""
    dense = dense_model("mlp")
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 12, (16,), generator=g)
    conf = TensorParallelismConfig(tensor_parallel_size=2, fusion_threshold_bytes=fusion,
                                   memory_optimization="None")
    groups = build_tp_groups(2, fusion_threshold_bytes=fusion)
    tpm = parallelize(copy.deepcopy(dense), conf, groups)
    d = groups.tp_index
    xs, ys = x[d * 8:(d + 1) * 8], y[d * 8:(d + 1) * 8]
    opt = torch.optim.SGD(tpm.parameters(), lr=0.5)
    out = tpm(xs)
    nn.functional.cross_entropy(out, ys).backward()
    n = tpm.sync_gradients()
    opt.step()
    ref = copy.deepcopy(dense)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    nn.functional.cross_entropy(ref(x), y).backward()
    ropt.step()
    full = tpm.dense_state_dict()
    diff = max(float((full[k] - p.detach()).abs().max()) for k, p in ref.named_parameters())
    return {"sync_collectives": n, "param_diff": diff, "dp_index": d, "tp_rank": tpm.comm.rank}


def hier_structure(ctx: WorkerContext) -> dict[str, Any]:
    tpm = _par(dense_model("mlp"), TensorParallelismConfig(
        tensor_parallel_size=ctx.world_size, communication_pattern="Hierarchical",
        memory_optimization="None"))
    tpm.stats.reset()
    tpm(model_input("mlp"))
    return tpm.statistics()["collectives"]


def suite_2(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    tp = ctx.world_size
    out: dict[str, Any] = {"parity": {}, "dtensor": {}}
    for kind in ["mlp", "attn", "encoder"]:
        for pattern in PATTERNS:
            out["parity"][f"{kind}/{pattern}"] = parity(kind, pattern, tp)
    out["parity"]["mlp/AllReduce/sync"] = parity("mlp", "AllReduce", tp, async_communication=False)
    out["parity"]["encoder/AllReduce/nofusion"] = parity("encoder", "AllReduce", tp,
                                                         fusion_threshold_bytes=0)
    out["parity"]["encoder/ReduceScatter/nofusion"] = parity("encoder", "ReduceScatter", tp,
                                                             fusion_threshold_bytes=0)
    out["parity"]["encoder/AllReduce/High"] = parity("encoder", "AllReduce", tp,
                                                     memory_optimization="High")
    from paratrain.comm import collectives as C

    saved = dict(C._FLAT)  # the fallbacks for backends without flat collectives
    C._FLAT.update({("all_gather", "gloo"): False, ("reduce_scatter", "gloo"): False})
    out["parity"]["encoder/ReduceScatter/fallback"] = parity("encoder", "ReduceScatter", tp)
    C._FLAT.clear()
    C._FLAT.update(saved)
    for kind in ["mlp", "attn"]:
        out["dtensor"][kind] = dtensor_parity(kind, tp)
    out["wrong"] = wrong_variant(tp)
    out["strategies"] = strategies(tp)
    out["random"] = random_parity(tp, 12)
    out["parity"]["mlp/BlockWise-fallback"] = parity("mlp", "AllReduce", tp,
                                                     partitioning_strategy="BlockWise")
    out["counts"] = {p: counts(p, tp) for p in PATTERNS}
    out["counts_sync"] = counts("AllReduce", tp, async_communication=False)
    out["attn_fused"] = attn_fusion_counts(tp, 1 << 20)
    out["attn_unfused"] = attn_fusion_counts(tp, 0)
    out["mp"] = mixed_precision(tp)
    out["memory"] = memory_levels(tp)
    out["sp_memory"] = sequence_parallel_memory(tp)
    out["accum"] = {a: grad_accum(tp, a) for a in (True, False)}
    tpm = _par(dense_model("mlp"), TensorParallelismConfig(tensor_parallel_size=tp))
    out["stats"] = tpm.statistics()
    return out


def suite_4(ctx: WorkerContext) -> dict[str, Any]:
    # Hierarchical groups follow the host topology: pose as two 2-rank torchrun nodes
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ.pop("GROUP_RANK", None)
    torch.manual_seed(0)
    tp = ctx.world_size
    out: dict[str, Any] = {"parity": {}}
    for kind in ["mlp", "attn", "encoder"]:
        for pattern in PATTERNS:
            out["parity"][f"{kind}/{pattern}"] = parity(kind, pattern, tp)
    out["dtensor"] = {"mlp": dtensor_parity("mlp_even", tp)}  # attention: at 2 ranks
    out["hier"] = hier_structure(ctx)
    out["strategies"] = strategies(tp)
    out["primitives"] = primitives(ctx)
    out["random"] = random_parity(tp, 12)
    out["counts"] = counts("AllReduce", tp)
    out["two_d"] = {f: two_d(ctx, f) for f in (0, 1 << 20)}
    try:  # 3 does not divide a world of 4
        parallelize(dense_model("mlp"), TensorParallelismConfig(tensor_parallel_size=3))
        out["bad_tp"] = None
    except ConfigError as e:
        out["bad_tp"] = str(e)
    dist.barrier()
    return out


def job_resume(ctx: WorkerContext, out_dir: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An uninterrupted 6-step run vs 3 steps + ``resume`` to 6: same final parameters.
    ``extra`` adds job sections (a DataParallel strategy, ``[compression]``)."""
    from paratrain.config import load_job
    from paratrain.executors.tensor_parallel.runner import worker_main

    def job(name: str, steps: int) -> Any:
        return load_job({
            "run": {"name": name, "seed": 3, "output_dir": out_dir, "checkpoint_every": 3},
            "model": {"name": "mlp", "hidden": [32, 32, 32]},
            "train": {"epochs": 1, "batch_size": 16, "max_steps": steps,
                      "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
            "tensor_parallel": {"tensor_parallel_size": 2, "micro_batches": 2,
                                "communication_pattern": "ReduceScatter",
                                "memory_optimization": "High"},
            **(extra or {}),
        })

    full = worker_main(ctx, job("full", 6), False)
    worker_main(ctx, job("split", 3), False)
    resumed = worker_main(ctx, job("split", 6), True)
    if ctx.rank != 0:
        return {}
    assert full is not None and resumed is not None
    return {"full": full["parameters_sha256"], "resumed": resumed["parameters_sha256"],
            "steps": (full["steps"], resumed["steps"]), "acc": full["test_accuracy"]}


def job_resume_cases(ctx: WorkerContext, cases: list[tuple[str, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """:func:`job_resume` for several ``(out_dir, extra)`` cases in one launch of the
    processes (each case still trains its own uninterrupted and split runs)."""
    return [job_resume(ctx, out_dir, extra) for out_dir, extra in cases]


def primitives(ctx: WorkerContext) -> dict[str, float]:
    """Every pattern's all-reduce (sync and async) on awkward sizes, and uneven all-gather /
    reduce-scatter, against the sums computed locally from every rank's seeded tensor."""
    p, r = ctx.world_size, ctx.rank

    def tensor_of(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + rank)
        return torch.randn(*shape, generator=g)

    errs: dict[str, float] = {}
    for pattern in PATTERNS:
        comm = build_tp_groups(p, pattern=pattern).tp
        worst = 0.0
        for shape in [(0,), (1,), (3,), (7, 5), (2, 3, 4)]:
            want = sum(tensor_of(k, shape) for k in range(p))
            mine = tensor_of(r, shape)
            got = comm.all_reduce(mine)
            got_async = comm.all_reduce_async(mine).wait()
            assert torch.equal(mine, tensor_of(r, shape))  # out of place
            for g_ in (got, got_async):
                worst = max(worst, float((g_ - want).abs().max()) if want.numel() else 0.0)
        comm.close()
        errs[pattern] = worst
    comm = build_tp_groups(p).tp
    sizes = ([2, 0, 3, 1] + [1] * p)[:p]
    mine = tensor_of(r, (2, sizes[r], 3))
    full = torch.cat([tensor_of(k, (2, sizes[k], 3)) for k in range(p)], dim=1)
    errs["all_gather_uneven"] = float((comm.all_gather(mine, 1, sizes).wait() - full).abs().max())
    total = tensor_of(r, (sum(sizes), 4))
    want = sum(tensor_of(k, (sum(sizes), 4)) for k in range(p))
    assert isinstance(want, torch.Tensor)
    part = comm.reduce_scatter(total, 0, sizes, async_op=True).wait()
    start = sum(sizes[:r])
    errs["reduce_scatter_uneven"] = float((part - want[start:start + sizes[r]]).abs().max()) if sizes[r] else 0.0
    grads = [tensor_of(r, (5,)), tensor_of(r, (2, 2)), tensor_of(r, (3,))]
    comm.fusion_threshold_bytes = 32  # buckets: [20 B], [16 B + 12 B]
    n = comm.all_reduce_coalesced_(grads, average=True)
    want_avg = [sum(tensor_of(k, t.shape) for k in range(p)) / p for t in grads]
    errs["coalesced"] = max(float((a - b).abs().max()) for a, b in zip(grads, want_avg, strict=True))
    errs["coalesced_collectives"] = n
    return errs


def random_parity(tp: int, cases: int, seed: int = 7) -> list[dict[str, Any]]:
    """Property: for seeded random MLP shapes (widths below tp included, batch of 1),
    patterns, strategies and switches, the parallel model equals the dense one."""
    import random

    rnd = random.Random(seed)
    out = []
    for c in range(cases):
        torch.manual_seed(c)  # identical full model on every rank
        widths = [rnd.choice([1, 2, 3, 5, 8, 13]) for _ in range(rnd.choice([3, 4, 5]))]
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(len(widths) - 1):
            layers[f"fc{i}"] = nn.Linear(widths[i], widths[i + 1], bias=rnd.random() < 0.8)
            layers[f"act{i}"] = rnd.choice([nn.ReLU, nn.Tanh, nn.GELU])()
        dense = nn.Sequential(layers)
        x = torch.randn(rnd.choice([1, 2, 5]), widths[0], generator=torch.Generator().manual_seed(c))
        pattern = rnd.choice(PATTERNS)
        strategy = rnd.choice(["ColumnWise", "RowWise", "Dynamic", "BatchWise", "ColumnWise"])
        if pattern == "ReduceScatter" and strategy in ("RowWise", "Dynamic"):
            strategy = "ColumnWise"
        conf = TensorParallelismConfig(
            tensor_parallel_size=tp, communication_pattern=pattern, partitioning_strategy=strategy,
            async_communication=rnd.random() < 0.5, memory_optimization=rnd.choice(["None", "High"]),
            fusion_threshold_bytes=rnd.choice([0, 1 << 20]))
        d_out, d_grads, d_x = dense_grads(copy.deepcopy(dense), x)
        t_out, t_grads, t_x = tp_grads(_par(copy.deepcopy(dense), conf), x)
        out.append({"case": f"{widths} {pattern} {strategy} B={x.shape[0]}",
                    "err": max(float((d_out - t_out).abs().max()), _maxdiff(d_grads, t_grads),
                               float((d_x - t_x).abs().max()))})
    return out
