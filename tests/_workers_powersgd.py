"""Worker for tests/compression/test_compression_powersgd.py: PowerSGD on 2 real gloo ranks against
torch's ``powerSGD_hook`` (run by paratrain.comm.testing.run_distributed)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.comm.collectives import CommCounter
from paratrain.comm.ddp_hook import ddp_hook
from paratrain.comm.grad_sync import GradSync
from paratrain.compression import Compressor

STEPS = 7
START = 2


def mlp(bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    # (32,16), (32,32), (16,32): each compressed at ranks 1, 2 and 4 (torch's rate rule).
    return nn.Sequential(nn.Linear(16, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias),
                         nn.ReLU(), nn.Linear(32, 16, bias=bias))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _strategy(rank: int) -> dict[str, Any]:
    return {"method": "PowerSGD", "rank": rank, "start_step": START}


def run_torch(rank: int, bias: bool, ctx: Any, seed: int = 0) -> list[torch.Tensor]:
    """torch DDP + powerSGD_hook (error feedback, warm start, min_compression_rate 2)."""
    model = mlp(bias)
    ddp = DDP(model)
    state = tp.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START,
                             use_error_feedback=True, warm_start=True, random_seed=seed)
    ddp.register_comm_hook(state, tp.powerSGD_hook)
    return _ddp_steps(ddp, ctx)


def _ddp_steps(ddp: DDP, ctx: Any) -> list[torch.Tensor]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(ctx.rank):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return _params(ddp.module)


def run_our_hook(rank: int, bias: bool, ctx: Any) -> list[torch.Tensor]:
    """torch DDP + paratrain's ddp_hook({"method": "PowerSGD", ...})."""
    model = mlp(bias)
    ddp = DDP(model)
    state, hook = ddp_hook(_strategy(rank), model=ddp, seed=0)
    ddp.register_comm_hook(state, hook)
    return _ddp_steps(ddp, ctx)


def _grad_sync_steps(model: nn.Module, opt: Any, sync: GradSync, batches: list[Any],
                     on_step: Callable[[], None] | None = None) -> None:
    for x, y in batches:
        opt.zero_grad()
        sync.before_forward()
        nn.functional.mse_loss(model(x), y).backward()
        sync.sync()
        opt.step()
        if on_step is not None:
            on_step()


def run_grad_sync(rank: int, bias: bool, ctx: Any) -> dict[str, Any]:
    """paratrain's GradSync (DataParallel's exchange) with a PowerSGD Compressor; bytes
    each step booked as all-reduce."""
    model = mlp(bias)
    counter = CommCounter()
    sync = GradSync(list(model.named_parameters()), group=ctx.group, overlap=True,
                    compressor=Compressor(_strategy(rank), seed=0), counter=counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_step: list[int] = []

    def book() -> None:
        per_step.append(counter.bytes.get("all_reduce", 0) - sum(per_step))

    _grad_sync_steps(model, opt, sync, _batches(ctx.rank), book)
    return {"params": _params(model), "bytes": per_step,
            "calls": counter.calls.get("all_reduce", 0)}


def run_resumed(rank: int, bias: bool, ctx: Any, folder: str, cut: int) -> list[torch.Tensor]:
    """GradSync + PowerSGD for ``cut`` steps, a checkpoint file, fresh objects loaded
    from it (weights_only), the remaining steps."""
    batches = _batches(ctx.rank)
    model = mlp(bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = GradSync(list(model.named_parameters()), group=ctx.group,
                    compressor=Compressor(_strategy(rank), seed=0))
    _grad_sync_steps(model, opt, sync, batches[:cut])
    path = os.path.join(folder, f"ckpt-{ctx.rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sync": sync.state_dict()}, path)
    del model, opt, sync
    ck = torch.load(path, weights_only=True)
    model = mlp(bias)
    model.load_state_dict(ck["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(ck["opt"])
    sync = GradSync(list(model.named_parameters()), group=ctx.group,
                    compressor=Compressor(_strategy(rank), seed=0))
    sync.load_state_dict(ck["sync"])
    _grad_sync_steps(model, opt, sync, batches[cut:])
    return _params(model)


def scenarios(ctx: Any, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for rank in (1, 2, 4):
        out[f"torch_r{rank}"] = run_torch(rank, False, ctx)
        gs = run_grad_sync(rank, False, ctx)
        out[f"ours_r{rank}"] = gs["params"]
        out[f"bytes_r{rank}"] = gs["bytes"]
        out[f"calls_r{rank}"] = gs["calls"]
    out["hook_r2"] = run_our_hook(2, False, ctx)
    out["torch_r2_seed1"] = run_torch(2, False, ctx, seed=1)
    out["torch_bias_r2"] = run_torch(2, True, ctx)
    out["ours_bias_r2"] = run_grad_sync(2, True, ctx)["params"]
    out["hook_bias_r2"] = run_our_hook(2, True, ctx)
    out["resumed_bias_r2"] = run_resumed(2, True, ctx, folder, cut=4)
    out["dp_full"] = [torch.from_numpy(a) for a in dp_job_runs(ctx, folder, "first")["full"]]
    return {k: [t.numpy() for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
            else v for k, v in out.items()}


def one(ctx: Any, which: str, rank: int = 2, bias: bool = False) -> list[Any]:
    """One run by name (debugging and the benchmark)."""
    torch.set_num_threads(1)
    fn = {"torch": run_torch, "hook": run_our_hook}.get(which)
    params = fn(rank, bias, ctx) if fn else run_grad_sync(rank, bias, ctx)["params"]
    return [t.numpy() for t in params]


def _dp_job(folder: str, name: str, steps: int) -> Any:
    from _workers_dp import dp_job
    from paratrain.config import load_job

    doc = dp_job(folder, name, 2, {"method": "AllReduce"},
                 compression={"method": "PowerSGD", "rank": 2, "start_step": 1}).to_json_dict()
    doc["run"]["checkpoint_every"] = 3
    doc["train"]["max_steps"] = steps
    return load_job(doc)


def dp_job_runs(ctx: Any, folder: str, phase: str) -> dict[str, Any]:
    """The DataParallel runner with PowerSGD: phase "first" trains 6 steps straight and 3
    steps of a second run (checkpointed at step 3); phase "second", in fresh processes,
    resumes that run to step 6 from its checkpoint."""
    from paratrain.executors.data_parallel.runner import train_replica

    flat = lambda m: [p.detach().numpy().copy() for p in m.parameters()]  # noqa: E731
    if phase == "first":
        model, _ = train_replica(ctx, _dp_job(folder, "full", 6), False, plot=False)
        train_replica(ctx, _dp_job(folder, "part", 3), False, plot=False)
        return {"full": flat(model)}
    model, summary = train_replica(ctx, _dp_job(folder, "part", 6), True, plot=False)
    return {"resumed": flat(model), "steps": summary["steps"]}
