"""Reference test of our ZeRO (:mod:`paratrain.executors.shared.zero`) against torch's own, 2
gloo ranks: DataParallel at ``shard`` = optimizer, gradients and parameters (ZeRO-1/2/3, through
``train_replica``'s loop) ends a few steps with the parameters torch
``DistributedDataParallel`` + ``torch.distributed.optim.ZeroRedundancyOptimizer`` reach on the
same init, the same per-rank batches and the same optimizer (SGD with momentum and weight
decay, Adam, AdamW), for an MLP and (AdamW) for a net with one weight tied across two units
(ZeRO keeps it in the root unit). Bit for bit: both average the gradients exactly (with 2
ranks DDP's divide-then-sum and our sum-then-divide are both exact halvings) and the optimizers
are element-wise, so stepping a rank's rows of a parameter (ours) or whole parameters (torch's)
computes the same numbers. torch has no ZeRO-2/3 reference here besides FSDP2, which on gloo
sums where it should average (pytorch#162338), so every level is held to DDP + ZeRO-1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _workers_dp import ddp_reference
from _workers_dp_zero import LEVELS, OPTIMIZERS, zero_job
from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed

pytestmark = [pytest.mark.timeout(300)]

TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
MODELS: dict[str, dict[str, Any]] = {"mlp": {"name": "mlp", "hidden": [16]},
                                     "tied": {"factory": "test_zero_vs_torch:make_tied"}}
CASES = [("mlp", opt) for opt in OPTIMIZERS] + [("tied", "adamw")]


class Tied(nn.Module):
    """64 -> 16 -> 16 -> 16 -> classes; the two middle layers (two units) share one weight."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.fc0, self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(torch.tanh(self.fc0(x))))
        return self.head(torch.tanh(self.b(h)))


def make_tied(*, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    assert input_shape == (64,)
    return Tied(num_classes)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _torch_zero(opt: str, lr_scale: float) -> Any:
    """``ZeroRedundancyOptimizer`` over torch's class for ``opt`` with the job's settings."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kwargs = {k: v for k, v in OPTIMIZERS[opt].items() if k != "name"}
    kwargs["lr"] *= lr_scale
    cls = TORCH_OPTIMIZERS[opt]
    return lambda params: ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)


def zero_vs_torch(ctx: WorkerContext, tmp: str) -> dict[str, dict[str, torch.Tensor]]:
    """Per case: the initial parameters, ours at each level, torch's and torch's at twice the lr."""
    from paratrain.data import load_data
    from paratrain.executors.data_parallel.runner import train_replica
    from paratrain.models import build_model
    from paratrain.training import seed_everything

    out: dict[str, dict[str, torch.Tensor]] = {}
    for model, opt in CASES:
        case = out[f"{model}-{opt}"] = {}
        for lvl in LEVELS[1:]:
            job = zero_job(tmp, f"{model}-{opt}-{lvl}", ctx.world_size, lvl, optimizer=opt,
                           model=MODELS[model])
            case[lvl] = _flat(train_replica(ctx, job, False, plot=False)[0])
        seed_everything(job.run.seed)
        bundle = load_data(job.data, seed=job.run.seed)
        case["init"] = _flat(build_model(job.model, input_shape=bundle.input_shape,
                                         num_classes=bundle.num_classes))
        for label, scale in (("torch", 1.0), ("torch_2lr", 2.0)):
            case[label] = torch.tensor(ddp_reference(ctx, job, optimizer=_torch_zero(opt, scale)),
                                       dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_distributed(zero_vs_torch, 2, str(tmp_path_factory.mktemp("zero_vs_torch")),
                           timeout_s=250)


@pytest.mark.parametrize("case", [f"{m}-{o}" for m, o in CASES])
def test_every_level_equals_ddp_with_zero_redundancy_optimizer(runs: list[dict[str, Any]],
                                                              case: str) -> None:
    for r in runs:
        got = r[case]
        for lvl in LEVELS[1:]:
            assert torch.equal(got[lvl], got["torch"]), (lvl, (got[lvl] - got["torch"]).abs().max())
        # non-vacuity: training moved the parameters, and a reference at another lr differs
        assert (got["torch"] - got["init"]).abs().max() > 1e-3
        assert (got["torch_2lr"] - got["torch"]).abs().max() > 1e-3
    assert torch.equal(runs[0][case]["torch"], runs[1][case]["torch"])  # the replicas agree


def test_the_tied_weight_is_one_parameter_in_the_root_unit(tmp_path: Path) -> None:
    from paratrain.executors.data_parallel.runner import shard_layout

    net = make_tied(input_shape=(64,), num_classes=10)
    assert net.a.weight is net.b.weight and len(list(net.parameters())) == 7
    (line,) = shard_layout(zero_job(str(tmp_path), "t", 2, "parameters", model=MODELS["tied"]))
    # a and b keep only their biases; the 16 x 16 tie is the root's
    assert "a (8 of 16), b (8 of 16)" in line and "(root) (128 of 256)" in line, line
