"""Worker for tests/executors/model_parallel/test_mp_schedules.py: one ModelParallel pipeline step per case on real
gloo ranks, every schedule (GPipe, 1F1B, Interleaved1F1B, ZBH1).

:class:`SkipTied`: an embedding, ``n`` blocks and a head whose logits read the embedding's
weight again (a tie: the weight stays on its rank, readers get it each step and send its
gradient back), with a skip connection from the embedding to the last block (it crosses
every stage in between). A case is a dict: ``schedule``, ``p`` (stages), ``chunks`` (node lists
in model order, chunk ``k`` on worker ``k mod p``; ranks ``>= p`` own nothing), ``rows``, ``mbs`` (micro-batch size), ``steps``
(the last is returned; earlier ones on other batches, receives posted ahead by then).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.config.strategy import load_strategy
from paratrain.executors.model_parallel.plan import build_plan, check_interleaved
from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules

__all__ = ["SkipTied", "build", "batch", "loss_fn", "reference", "run_cases", "chunks"]

D, CLASSES, BLOCKS = 6, 8, 8


class TiedHead(nn.Module):
    """Logits ``proj(h) @ E`` with ``E`` the embedding's weight (read, not copied)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h) @ self.weight  # (rows, D) @ (D, CLASSES)


class SkipTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(CLASSES, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(BLOCKS))
        self.head = TiedHead(self.embed.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = skip = self.embed(x)
        for k, block in enumerate(self.blocks):
            h = torch.tanh(block(h)) + (skip if k == BLOCKS - 1 else h)
        return self.head(h)


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return SkipTied()


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(rows, CLASSES, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def loss_fn(out: torch.Tensor, b: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out, b[1])


def chunks(n: int) -> list[list[str]]:
    """The model's modules in ``n`` consecutive chunks (``n`` divides 8 or is 2, 4, 8)."""
    names = ["embed"] + [f"blocks.{k}" for k in range(BLOCKS)] + ["head"]
    inner = names[1:-1]
    per = len(inner) // n
    out = [inner[k * per:(k + 1) * per] for k in range(n)]
    out[0].insert(0, "embed")
    out[-1].append("head")
    return out


def reference(seed: int, rows: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(seed)
    x, y = batch(rows, seed)
    loss = loss_fn(model(x), (x, y))
    loss.backward()
    return float(loss.detach()), {k: p.grad.detach().clone() for k, p in model.named_parameters()
                                  if p.grad is not None}


def run_cases(ctx: WorkerContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from paratrain.comm.p2p import P2PTransport

    out = []
    transport = P2PTransport(ctx.group)
    placed: dict[tuple[str, str], tuple[nn.Module, Any, int]] = {}  # one trace per placement
    for index, case in enumerate(cases):
        started = time.perf_counter()
        p = case["p"]  # stages; ranks from p on own nothing in this case
        parts = [{"node_ids": nodes, "target": {"WorkerId": f"worker-{k % p}"}}
                 for k, nodes in enumerate(case["chunks"])]
        strategy = load_strategy({"type": "ModelParallel", "partitions": parts, "communication": {
            "protocol": "Pipeline", "micro_batch_size": case["mbs"], "schedule": case["schedule"]}})
        interleaved = case["schedule"] == "Interleaved1F1B"
        key = (repr(case["chunks"]), str(interleaved))
        if key not in placed:
            model = build(0)
            plan = build_plan(model, strategy.partitions, ctx.workers, contiguous=not interleaved)
            placed[key] = (model, plan, check_interleaved(plan, ctx.workers, None) if interleaved else 1)
        model, plan, v = placed[key]
        with torch.no_grad():  # the parts share the model's tensors: the case's seeded values
            model.load_state_dict(build(case["seed"]).state_dict())
        model.zero_grad(set_to_none=True)
        rt = StageRuntime(plan, ctx.rank, segment_modules(model, plan, ctx.rank), transport,
                          attrs=held_attrs(model, plan, ctx.rank))
        kw = {"micro_batch_size": case["mbs"], "schedule_name": case["schedule"], "loss_fn": loss_fn}
        for k in range(case.get("steps", 1) - 1):
            rt.run_batch(batch(case["rows"], 50 + k), step=2 * index, **kw)
            model.zero_grad(set_to_none=True)
        loss = rt.run_batch(batch(case["rows"], case["seed"]), step=2 * index + 1, **kw)
        grads = {k: q.grad.detach().numpy().copy() for k, q in model.named_parameters()
                 if q.grad is not None}
        out.append({"loss": loss, "grads": grads, "order": rt.stats.order, "v": v,
                    "parts": sorted(rt.parts), "peak": rt.stats.peak_activation_bytes,
                    "num_parts": plan.num_segments,
                    "seconds": time.perf_counter() - started})
    transport.flush()
    return out
