"""A replicated pipeline stage whose parameters are used data-dependently.

Three gloo ranks: stage 0 (``front``) on rank 0, stage 1 (``back``: a gate with a branch
taken only for rows whose first feature passes a threshold, then the head) replicated on
ranks 1 and 2 (``[subgraphs.back] type = "DataParallel"``), a GPipe of two micro-batches.
The rows are ordered so that only replica 1 takes the branch (``one``), or nobody does
(``none``). :class:`~paratrain.executors.model_parallel.engine.PipelineEngine` runs the
step and its sync: each replica's gradients must equal the unpartitioned model's on the
whole batch, a branch nobody took keeps ``grad = None`` (as in the reference), and nothing
hangs (the replicas hand the collective the same tensors whether or not they took the
branch). A running mean kept in a buffer of the stage checks the buffer broadcast: both
replicas start the second step from the primary's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

ROWS = 8
MICRO = 4


class Gate(nn.Module):
    """``fc(h)``, plus ``branch(h)`` on the rows with ``h[:, 0] > threshold`` (a leaf of the
    trace: its control flow is on values)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.threshold = 0.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.fc(h)
        mask = h[:, 0] > self.threshold
        if bool(mask.any()):
            out = out + torch.where(mask[:, None], self.branch(h), torch.zeros_like(out))
        return out


class Tracker(nn.Module):
    """A running mean of its input rows in a buffer (as BatchNorm keeps), output unchanged
    (so the stage's gradients stay row-separable and equal the unpartitioned model's)."""

    running_mean: torch.Tensor

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training and h.shape[0] > 0:
            self.running_mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return h


class Back(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.track = Tracker()
        self.head = nn.Linear(8, 5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.track(self.gate(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Linear(8, 8)
        self.back = Back()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(x))


def loss_fn(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def case(which: str) -> tuple[Net, torch.Tensor, torch.Tensor]:
    """The model (threshold set) and a batch ordered by ``front(x)[:, 0]``: replica 0 holds
    rows 0, 1, 4, 5 of the two micro-batches, replica 1 rows 2, 3, 6, 7; ``one`` puts the
    threshold between rows 5 and 6 (only replica 1 takes the branch), ``none`` above all."""
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 8, generator=g), torch.randint(0, 5, (ROWS,), generator=g)
    with torch.no_grad():
        h0 = model.front(x)[:, 0]
    order = h0.argsort()
    x, y, h0 = x[order], y[order], h0[order]
    model.back.gate.threshold = (float(h0[5] + h0[6]) / 2 if which == "one"
                                 else float(h0.max()) + 1.0)
    return model, x, y


def reference(which: str) -> dict[str, Any]:
    model, x, y = case(which)
    loss_fn(model(x), (x, y)).backward()
    return {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}


def run_stage(ctx: WorkerContext, which: str) -> dict[str, Any]:
    """One PipelineEngine step (and its sync) of the case; this rank's gradients by the
    model's names (None where the parameter got none), and, after a second step, the
    running mean each replica's Tracker holds before its forwards."""
    from _workers_mp_graph import _replicas
    from paratrain.comm.p2p import P2PTransport
    from paratrain.config.strategy import load_strategy
    from paratrain.executors.model_parallel.engine import PipelineEngine, StageModel
    from paratrain.executors.model_parallel.plan import build_plan
    from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules

    model, x, y = case(which)
    strategy = load_strategy({
        "type": "ModelParallel",
        "partitions": [{"node_ids": ["back"], "target": {"WorkerId": "worker-1"}}],
        "communication": {"protocol": "Pipeline", "micro_batch_size": MICRO, "schedule": "GPipe"}})
    plan = build_plan(model, strategy.partitions, ctx.workers, contiguous=True, leaves=["back.gate", "back.track"])
    replicas, group = _replicas(ctx, {"replicas": {"back": 2}}, strategy, plan)
    rank, replica = replicas.logical(ctx.rank)
    modules = segment_modules(model, plan, rank)
    attrs = held_attrs(model, plan, rank)
    stage = StageModel(modules, attrs, plan.segments_of(rank))
    rt = StageRuntime(plan, rank, modules, P2PTransport(ctx.group), attrs=attrs, replicas=replicas,
                      physical_rank=ctx.rank)
    engine = PipelineEngine(ctx, rt, stage, SimpleNamespace(loss=loss_fn), None, precision="fp32",
                            micro_batch_size=MICRO, schedule_name="GPipe", replica_group=group)
    engine.forward_backward((x, y), weight=1.0, last=True)
    engine.sync()
    names = {id(p): k for k, p in model.named_parameters()}  # the parts hold the model's tensors
    grads = {names[id(p)]: None if p.grad is None else p.grad.clone() for p in stage.parameters()}
    # a second step: both replicas start it from the primary's running mean
    stage.zero_grad(set_to_none=True)
    seen: list[list[float]] = []
    norms = [m for m in stage.modules() if isinstance(m, Tracker)]
    hooks = [m.register_forward_pre_hook(lambda m, _a: seen.append(m.running_mean.tolist()))
             for m in norms]
    engine.forward_backward((x, y), weight=1.0, last=True)
    engine.sync()
    for h in hooks:
        h.remove()
    return {"rank": rank, "replica": replica, "grads": grads, "seen": seen}


@pytest.fixture(scope="module", params=["one", "none"])
def which(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def results(which: str) -> list[dict[str, Any]]:
    return run_distributed(run_stage, 3, which, timeout_s=120)


def test_branch_pattern(which: str) -> None:
    """Non-vacuity: in ``one`` the branch is used (by replica 1's rows only)."""
    model, x, _ = case(which)
    with torch.no_grad():
        takes = (model.front(x)[:, 0] > model.back.gate.threshold).tolist()
    replica1 = [2, 3, 6, 7]
    assert takes == ([i in replica1 and i >= 6 for i in range(ROWS)] if which == "one" else [False] * ROWS)


def test_replicas_gradients_equal_the_unpartitioned_model(results: list[dict[str, Any]],
                                                          which: str) -> None:
    ref = reference(which)
    assert [r["replica"] for r in results] == [0, 0, 1]
    for r in results[1:]:
        assert set(r["grads"]) == {k for k in ref if k.startswith("back.")}
        for k, g in r["grads"].items():
            if ref[k] is None:
                assert g is None, f"{k}: no replica used it, yet it has a gradient"
            else:
                assert g is not None, k
                torch.testing.assert_close(g, ref[k], rtol=1e-5, atol=1e-6, msg=k)
    branch = ref["back.gate.branch.weight"]
    assert (branch is not None and float(branch.abs().max()) > 0) == (which == "one")


def test_replicas_start_each_step_from_the_primarys_buffers(results: list[dict[str, Any]]) -> None:
    """Each replica updates the running mean with its own rows (the step's second
    micro-batch starts from different values), and the next step starts from the
    primary's on both (the broadcast before its first forward)."""
    a, b = results[1]["seen"], results[2]["seen"]
    assert len(a) == len(b) == ROWS // MICRO
    assert a[0] == b[0] and a[1] != b[1]
