"""DataParallel and buffers: ``strategy.broadcast_buffers`` (on by default, as torch DDP).

A BatchNorm model on 2 gloo ranks, each replica on its own shard: every training forward
records the running statistics it starts from. With the broadcast they are rank 0's on both
ranks at every step, and the run equals torch ``DistributedDataParallel(broadcast_buffers=True)``
on the same shards, rank by rank (parameters and buffers). Without it (non-vacuity) the
replicas' statistics drift apart after the first step, and differ from DDP's. The same
through tensor parallel x DataParallel (tp 2 x dp 2, the TensorParallelEngine's steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

SEED = 5
STEPS = 4
BATCH = 8
SGD: dict[str, Any] = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


class BNNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear; ``seen`` holds the running mean (and the
    batches tracked) each training forward starts from."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, num_classes)
        self.seen: list[list[float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            assert self.bn.running_mean is not None and self.bn.num_batches_tracked is not None
            self.seen.append([*self.bn.running_mean.tolist(), float(self.bn.num_batches_tracked)])
        return self.head(torch.relu(self.bn(self.fc(x))))


def make_net(*, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    assert input_shape == (64,)
    return BNNet(num_classes)


def _job(tmp: str, name: str, aggregation: str, broadcast: bool | None) -> Any:
    from paratrain.config import load_job

    strategy: dict[str, Any] = {"type": "DataParallel", "num_replicas": 2,
                                "aggregation": {"method": aggregation}}
    if broadcast is not None:
        strategy["broadcast_buffers"] = broadcast
    return load_job({
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": 0},
        "model": {"factory": "test_dp_broadcast_buffers:make_net"},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": BATCH, "max_steps": STEPS, "optimizer": SGD},
        "strategy": strategy,
    })


def _result(model: nn.Module) -> dict[str, Any]:
    state = {k: v.detach().double().reshape(-1).tolist() for k, v in model.state_dict().items()}
    return {"state": state, "seen": list(model.seen)}  # type: ignore[arg-type]


def _ddp(ctx: WorkerContext, job: Any) -> dict[str, Any]:
    """torch DDP(broadcast_buffers=True) on the same shards, init and optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.data import load_data
    from paratrain.executors.data_parallel.runner import shard_indices
    from paratrain.models import build_model
    from paratrain.training import build_optimizer, seed_everything

    seed_everything(job.run.seed)
    bundle = load_data(job.data, seed=job.run.seed)
    x, y = bundle.train.tensors
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    ddp = DDP(model, broadcast_buffers=True)
    opt = build_optimizer(ddp.parameters(), job.train.optimizer)
    idx = shard_indices(len(y), world=ctx.world_size, rank=ctx.rank, seed=job.run.seed, epoch=0)
    for b in range(STEPS):
        sel = idx[b * BATCH : (b + 1) * BATCH]
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x[sel]), y[sel]).backward()
        opt.step()
    return _result(model)


def train_variants(ctx: WorkerContext, tmp: str) -> dict[str, Any]:
    from paratrain.executors.data_parallel.runner import train_replica

    out: dict[str, Any] = {"ddp": _ddp(ctx, _job(tmp, "ddp", "AllReduce", None))}
    for name, agg, broadcast in (("allreduce", "AllReduce", None), ("ps", "ParameterServer", True),
                                 ("off", "AllReduce", False)):
        model, _ = train_replica(ctx, _job(tmp, name, agg, broadcast), False, plot=False)
        out[name] = _result(model)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(train_variants, 2, str(tmp_path_factory.mktemp("bn")), timeout_s=240)


def _t(v: list[Any]) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def test_default_is_on_and_dumped_only_when_set() -> None:
    from paratrain.config import ConfigError
    from paratrain.config.strategy import dump_strategy, load_strategy

    doc = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    s = load_strategy(doc)
    assert s.broadcast_buffers is True and dump_strategy(s) == doc
    off = load_strategy({**doc, "broadcast_buffers": False})
    assert off.broadcast_buffers is False and dump_strategy(off)["broadcast_buffers"] is False
    with pytest.raises(ConfigError, match="broadcast_buffers"):
        load_strategy({**doc, "broadcast_buffers": "yes"})


@pytest.mark.parametrize("name", ["allreduce", "ps", "ddp"])
def test_buffers_are_rank_zeros_at_every_step(results: list[dict[str, Any]], name: str) -> None:
    a, b = (r[name]["seen"] for r in results)
    assert len(a) == len(b) == STEPS
    for k in range(STEPS):
        assert a[k] == b[k], f"{name}: step {k} started from different running statistics"
    assert a[-1][-1] == STEPS - 1  # rank 0's count of batches tracked, on both


@pytest.mark.parametrize("name", ["allreduce", "ps"])
def test_parameters_and_buffers_equal_ddp_broadcast_buffers(results: list[dict[str, Any]],
                                                             name: str) -> None:
    for r in results:
        assert r[name]["state"].keys() == r["ddp"]["state"].keys()
        for k, v in r["ddp"]["state"].items():
            torch.testing.assert_close(_t(r[name]["state"][k]), _t(v), rtol=1e-6, atol=1e-7,
                                       msg=f"{name}: {k} differs from DDP's")


def test_without_broadcast_the_replicas_drift_apart(results: list[dict[str, Any]]) -> None:
    a, b = (r["off"]["seen"] for r in results)
    assert a[0] == b[0]  # the initial broadcast
    assert all(a[k] != b[k] for k in range(1, STEPS))
    rank1 = results[1]
    assert not torch.allclose(_t(rank1["off"]["state"]["bn.running_mean"]),
                              _t(rank1["ddp"]["state"]["bn.running_mean"]))


# ------------------------------------------------------------ tensor parallel x DP


def tp_dp_buffers(ctx: WorkerContext, broadcast: bool) -> list[list[float]]:
    """tp 2 x dp 2: three TensorParallelEngine steps, each replica on its own batch; the
    running mean a buffer holds at the start of each step's forward."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from test_mp_replica_sync import Tracker

    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.config import TensorParallelismConfig
    from paratrain.executors.tensor_parallel.engine import TensorParallelEngine
    from paratrain.tensor_parallel import parallelize

    torch.manual_seed(0)
    dense = nn.Sequential(OrderedDict(fc0=nn.Linear(16, 30), act=nn.GELU(), fc1=nn.Linear(30, 12),
                                      track=Tracker(12)))
    groups = build_tp_groups(2)
    conf = TensorParallelismConfig(tensor_parallel_size=2, memory_optimization="None")
    tpm = parallelize(dense, conf, groups, broadcast_buffers=broadcast)
    task = SimpleNamespace(loss=lambda out, b: nn.functional.cross_entropy(out, b[1]))
    engine = TensorParallelEngine(tpm, task, None, device=torch.device("cpu"))
    seen: list[list[float]] = []
    track = tpm.module.track
    track.register_forward_pre_hook(lambda m, _a: seen.append(m.running_mean.tolist()))
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + groups.tp_index)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 12, (8,), generator=g)
        engine.forward_backward((x, y), weight=1.0, last=True)
        engine.sync()
        tpm.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("broadcast", [True, False], ids=["on", "off"])
def test_tensor_parallel_x_dp_broadcasts_buffers(broadcast: bool) -> None:
    seen = run_distributed(tp_dp_buffers, 4, broadcast, timeout_s=200)
    assert all(len(s) == 3 for s in seen)
    assert seen[0] == seen[1] and seen[2] == seen[3]  # a TP group sees the same rows
    assert seen[0][0] == seen[2][0]  # the initial model
    later = [seen[0][k] == seen[2][k] for k in (1, 2)]
    assert later == ([True, True] if broadcast else [False, False])
