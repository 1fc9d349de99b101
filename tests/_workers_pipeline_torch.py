"""Worker for tests/executors/model_parallel/test_pipeline_vs_torch.py: paratrain's pipeline schedules and
``torch.distributed.pipelining``'s on the same stages, in the same gloo processes.

The model is the token MLP of ``benchmarks/model_parallel.py`` (``Embedding`` then
``BLOCKS`` blocks ``Linear + ReLU`` then a ``Linear`` head), cut as
``benchmarks/pipeline_schedules.py`` cuts it: ``n`` runs of equally many blocks, the
embedding joining the first, the head the last; chunk ``k`` on rank ``k mod p``. Per case,
two copies of the model are built from the same seed: paratrain's :class:`StageRuntime`
runs its schedule on one (fx parts sharing that copy's parameters), torch's schedule runs on
``nn.Sequential`` stages made of the other copy's modules (on a process group of its own,
so neither library's messages can meet the other's). Both see the same batch, split into the
same ``m`` equal micro-batches, with the same mean cross-entropy per micro-batch.

A case runs ``STEPS`` steps (gradients zeroed before each; the later ones run with
receives posted ahead and torch's shapes cached) and returns, per step and per library, the
per-micro-batch losses (on the loss rank) and every gradient this rank's parameters got. A
last paratrain-only step runs the final batch with one token of micro-batch ``perturb``
changed: the test's comparison must fail on it (non-vacuity).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.config.strategy import Partition
from paratrain.executors.model_parallel.plan import build_plan
from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules

__all__ = ["build", "batch", "chunks", "reference", "run_cases", "WIDTH", "BLOCKS", "VOCAB", "CLASSES"]

WIDTH, BLOCKS, VOCAB, CLASSES = 16, 4, 64, 10
STEPS = 2


def build(seed: int) -> nn.Sequential:
    """The benchmark's token MLP, seeded."""
    torch.manual_seed(seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["embed"] = nn.Embedding(VOCAB, WIDTH)
    for i in range(BLOCKS):
        layers[f"fc{i}"] = nn.Linear(WIDTH, WIDTH)
        layers[f"act{i}"] = nn.ReLU()
    layers["head"] = nn.Linear(WIDTH, CLASSES)
    return nn.Sequential(layers)


def chunks(n: int) -> list[list[str]]:
    """``n`` runs of equally many blocks; the embedding joins the first, the head the last."""
    names = ["embed"] + [f"{k}{i}" for i in range(BLOCKS) for k in ("fc", "act")] + ["head"]
    body = names[1:-1]
    per = len(body) // n
    out = [body[k * per:(k + 1) * per] for k in range(n)]
    return [(["embed"] if k == 0 else []) + c + (["head"] if k == n - 1 else []) for k, c in enumerate(out)]


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, VOCAB, (rows,), generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def reference(seed: int, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unpartitioned model in one process: per-micro-batch losses and the gradients of
    the mean of those losses (the step's loss with equal micro-batches)."""
    model = build(seed)
    losses = [nn.functional.cross_entropy(model(xs), ys) for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True)]
    torch.stack(losses).mean().backward()
    return [float(v.detach()) for v in losses], {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _ours(rt: StageRuntime, model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int,
          schedule: str, step: int) -> dict[str, Any]:
    """One paratrain step; the batch carries its row indices so the loss function knows
    which micro-batch it is given (whatever order the schedule runs them in)."""
    rows = x.shape[0]
    seen: dict[int, float] = {}

    def loss_fn(out: torch.Tensor, mb: Any) -> torch.Tensor:
        loss = nn.functional.cross_entropy(out, mb[1])
        seen[int(mb[2][0]) // (rows // m)] = float(loss.detach())
        return loss

    model.zero_grad(set_to_none=True)
    step_loss = rt.run_batch((x, y, torch.arange(rows)), step=step, micro_batch_size=rows // m,
                             schedule_name=schedule, loss_fn=loss_fn)
    return {"losses": [seen[i] for i in sorted(seen)], "micro_ids": sorted(seen), "step_loss": step_loss,
            "grads": _grads(model), "order": list(rt.stats.order)}


def _torch_step(sched: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int,
                p: int) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    if rank == 0:
        sched.step(x)
    elif rank == p - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return {"losses": [float(v.detach()) for v in losses], "grads": _grads(model)}


def run_cases(ctx: WorkerContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case on this rank (see the module docstring); results in case order."""
    from torch.distributed import pipelining as pp

    from paratrain.comm.p2p import P2PTransport

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    p, rank = ctx.world_size, ctx.rank
    transport = P2PTransport(ctx.group)
    torch_group = dist.new_group(backend="gloo")  # torch's messages apart from paratrain's
    out: list[dict[str, Any]] = []
    step = 0
    for case in cases:
        started = time.perf_counter()
        ours_name, torch_name, v, m, rows = case["ours"], case["torch"], case["v"], case["m"], case["rows"]
        split = chunks(v * p)
        # paratrain: its schedule on one copy
        model = build(case["seed"])
        parts = [Partition.model_validate({"node_ids": ns, "target": {"WorkerId": f"worker-{k % p}"}})
                 for k, ns in enumerate(split)]
        plan = build_plan(model, parts, ctx.workers, contiguous=v == 1)
        rt = StageRuntime(plan, rank, segment_modules(model, plan, rank), transport,
                          attrs=held_attrs(model, plan, rank))
        # torch: its schedule on stages made of the other copy's modules
        ref = build(case["seed"])
        stages = [pp.PipelineStage(nn.Sequential(*[ref.get_submodule(n) for n in split[k]]), k, len(split),
                                   torch.device("cpu"), group=torch_group)
                  for k in range(rank, len(split), p)]
        cls = getattr(pp, torch_name)
        loss = lambda out_, target: nn.functional.cross_entropy(out_, target)  # noqa: E731
        single = issubclass(cls, pp.schedules.PipelineScheduleSingle)
        sched = cls(stages[0] if single else stages, m, loss_fn=loss)
        res: dict[str, Any] = {"steps": [], "parts": sorted(rt.parts)}
        for k in range(STEPS):
            x, y = batch(rows, case["seed"] + k)
            ours = _ours(rt, model, x, y, m, ours_name, step)
            step += 1
            dist.barrier()
            theirs = _torch_step(sched, ref, x, y, rank, p)
            dist.barrier()
            res["steps"].append({"ours": ours, "torch": theirs})
        # non-vacuity: the last batch with one token of micro-batch `perturb` changed
        x, y = batch(rows, case["seed"] + STEPS - 1)
        x = x.clone()
        row = case["perturb"] * (rows // m)
        x[row] = (x[row] + 1) % VOCAB
        res["perturbed"] = _ours(rt, model, x, y, m, ours_name, step)
        step += 1
        dist.barrier()
        res["seconds"] = time.perf_counter() - started
        out.append(res)
    transport.flush()
    return out
