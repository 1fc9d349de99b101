"""Models of any topology and a worker that runs one ModelParallel step per case.

- :class:`ResNet`: a stem, residual blocks ``h = h + block(h)`` written in the root's
  forward, and a head: a cut between blocks sends the residual stream *and* the block's
  output; a cut inside a block sends the skip across.
- :class:`TwoTower`: two towers read the same input; a join reads both (towers on two
  workers, the join on a third).
- the zoo ``gpt`` (tied head: the head reads the token embedding's weight).

``run_cases(ctx, cases)``: each case builds its seeded model, plans the partitions, runs
one train step (``steps`` of them; the last is returned) and returns this rank's loss,
gradients by parameter name, and the forward's output; ``drop`` = a transfer index whose
payload a wrapped transport replaces by zeros (the non-vacuity check).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.comm.collectives import all_reduce_
from paratrain.comm.context import WorkerContext
from paratrain.config.job import ModelSpec
from paratrain.config.strategy import load_strategy
from paratrain.executors.model_parallel.plan import build_plan
from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules

__all__ = ["ResNet", "TwoTower", "RandomDag", "build", "batch", "loss_fn", "reference", "run_cases"]


class ResNet(nn.Module):
    def __init__(self, d: int = 12, depth: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(8, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(torch.relu(h))


class Tower(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.fc1(x)


class TwoTower(nn.Module):
    def __init__(self, d: int = 10, classes: int = 5) -> None:
        super().__init__()
        self.left, self.right = Tower(d), Tower(d)
        self.join = nn.Linear(2 * d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.left(x), self.right(x * 0.5)
        return self.join(torch.cat([a, b * a.mean(dim=-1, keepdim=True)], dim=-1))


class RandomDag(nn.Module):
    """Value 0 is ``stem(x)``; value i reads one or two earlier values (add, mul or cat ->
    a projection) through its own Linear; the output reads the last two values."""

    def __init__(self, spec: list[tuple[int, int, str]], d: int = 6) -> None:
        super().__init__()
        self.spec = spec
        self.stem = nn.Linear(8, d)
        self.layers = nn.ModuleList(
            nn.Linear(2 * d if op == "cat" else d, d) for _, _, op in spec)
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vals = [self.stem(x)]
        for layer, (a, b, op) in zip(self.layers, self.spec, strict=True):
            u, v = vals[a % len(vals)], vals[b % len(vals)]
            z = torch.cat([u, v], -1) if op == "cat" else (u + v if op == "add" else u * torch.tanh(v))
            vals.append(layer(z))
        return self.head(vals[-1] + vals[-2 % len(vals)])


def build(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(case.get("seed", 0))
    if case["model"] == "resnet":
        return ResNet()
    if case["model"] == "towers":
        return TwoTower()
    if case["model"] == "dag":
        return RandomDag([tuple(t) for t in case["spec"]])  # type: ignore[misc]
    if case["model"] == "towers-flat":
        return towers((8,), 5)
    from paratrain.models import build_model

    spec = ModelSpec(name="gpt", n_layer=2, n_head=2, n_embd=16, block_size=12)
    return build_model(spec, input_shape=(12,), num_classes=11)


def batch(case: dict[str, Any], rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    if case["model"] == "gpt":
        ids = torch.randint(0, 11, (rows, 13), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return torch.randn(rows, 8, generator=g), torch.randint(0, 5, (rows,), generator=g)


def loss_fn(out: torch.Tensor, b: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), b[1].reshape(-1))


def reference(case: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(case)
    x, y = batch(case, case["rows"])
    loss = loss_fn(model(x), (x, y))
    loss.backward()
    return float(loss.detach()), {k: p.grad.detach().clone() for k, p in model.named_parameters()
                                  if p.grad is not None}


def _replicas(ctx: WorkerContext, case: dict[str, Any], strategy: Any, plan: Any) -> tuple[Any, Any]:
    """The case's replicated stage (``case["replicas"] = {path: num_replicas}``) and this
    rank's replica group (every rank creates every group)."""
    from types import SimpleNamespace

    from paratrain.comm.groups import new_group
    from paratrain.config.strategy import load_strategy as strat
    from paratrain.executors.model_parallel.plan import Replicas, replicas_for

    subs = {k: strat({"type": "DataParallel", "num_replicas": r, "aggregation": {"method": "AllReduce"}})
            for k, r in (case.get("replicas") or {}).items()}
    if not subs:
        return Replicas(), None
    job = SimpleNamespace(strategy=strategy, subgraphs=subs)
    replicas = replicas_for(job, plan, ctx.world_size)
    mine = None
    for r in sorted(replicas.groups):
        g = new_group(list(replicas.groups[r]))
        if ctx.rank in replicas.groups[r]:
            mine = g
    return replicas, mine


class _Dropping:
    """A transport that sends zeros instead of transfer ``index``'s activations."""

    def __init__(self, inner: Any, index: int) -> None:
        self.inner, self.index = inner, index

    def send(self, tensor: torch.Tensor, **kw: Any) -> None:
        if kw["key"][0] == "act" and kw["key"][2] == self.index:
            tensor = torch.zeros_like(tensor)
        self.inner.send(tensor, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_cases(ctx: WorkerContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from paratrain.comm.p2p import P2PTransport

    out = []
    for index, case in enumerate(cases):
        strategy = load_strategy({"type": "ModelParallel", "partitions": case["partitions"],
                                  "communication": case["communication"]})
        proto = strategy.communication
        pipeline = proto.protocol == "Pipeline"
        model = build(case)
        plan = build_plan(model, strategy.partitions, ctx.workers, contiguous=pipeline)
        if proto.protocol == "DataStore":
            from paratrain.comm.p2p import DataStoreTransport, open_session

            store = open_session(f"{case['datastore_dir']}/case{index}", rank=ctx.rank,
                                 control=ctx.store, generation=index, timeout_s=60)
            transport: Any = DataStoreTransport(store, ctx.rank)
        else:
            transport = P2PTransport(ctx.group)
        if case.get("drop") is not None:
            transport = _Dropping(transport, case["drop"])
        replicas, group = _replicas(ctx, case, strategy, plan)
        rank, replica = replicas.logical(ctx.rank)
        attrs = held_attrs(model, plan, rank)
        rt = StageRuntime(plan, rank, segment_modules(model, plan, rank), transport, attrs=attrs,
                          replicas=replicas, physical_rank=ctx.rank)
        x, y = batch(case, case["rows"])
        kw = {"micro_batch_size": proto.micro_batch_size if pipeline else None,
              "schedule_name": proto.schedule if pipeline else None, "loss_fn": loss_fn}
        for k in range(case.get("steps", 1) - 1):
            rt.run_batch(batch(case, case["rows"], seed=7 + k), step=2 * index + k, **kw)
            model.zero_grad(set_to_none=True)
        loss = rt.run_batch((x, y), step=2 * index + 1, **kw)
        if group is not None:  # what PipelineEngine.sync does: sum the replicas' gradients
            for p in model.parameters():
                if p.grad is not None:
                    all_reduce_(p.grad, group=group)
            if rt.loss_part in rt.parts:
                part = torch.tensor([loss or 0.0], dtype=torch.float64)
                all_reduce_(part, group=group)
                loss = float(part[0]) if replica == 0 else None
        logits = rt.forward(x, step=index)
        grads = {}
        for part in plan.segments_of(rank) if replica == 0 else []:
            for k, p in part.module.named_parameters():
                if p.grad is not None:
                    grads[part.original_name(k)] = p.grad.detach().numpy().copy()
        for name, t in attrs.items() if replica == 0 else {}.items():
            del name
            for k, p in model.named_parameters():
                if p is t and p.grad is not None:
                    grads[k] = p.grad.detach().numpy().copy()
        if proto.protocol == "DataStore":
            transport.close()
        out.append({"loss": loss, "grads": grads,
                    "logits": None if logits is None else logits.numpy().copy(),
                    "parts": [p.index for p in plan.segments_of(rank)] if replica == 0 else [],
                    "replica": replica,
                    "transfers": len(plan.cut.transfers)})
    return out


def towers(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """A model factory (``model.factory = "_workers_mp_graph:towers"``): two towers over the
    flattened input, joined."""
    import math

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(math.prod(input_shape), 8)
            self.net = TwoTower(d=width, classes=num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(self.proj(x.flatten(1)))

    return Flat()
