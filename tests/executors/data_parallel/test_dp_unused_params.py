"""DataParallel and parameters without a gradient (DDP's ``find_unused_parameters`` rule).

A layer no rank uses keeps ``grad = None`` so the optimizer skips it: momentum + weight
decay (SGD) or AdamW's decoupled decay must not move it. A layer some ranks use is
averaged with zeros from the others. On 2 gloo ranks every aggregation is compared with
torch ``DistributedDataParallel(find_unused_parameters=True)`` (with paratrain's DDP
compression hook for the compressed AllReduce), and the dead layer is checked to be
bit-identical to its initial value.

The model (:func:`make_net`) has ``dead`` (never called), ``rank_branch`` (called on rank
0 only) and, with ``data_branch=True``, ``data_branch`` (called when the batch's mean
pixel exceeds :data:`THRESHOLD`: on 5 steps of the digits shards this gives steps where
one rank, both, or neither use it, including "neither" right after it was used).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

THRESHOLD = 0.31
SEED = 3
STEPS = 5
BATCH = 8
SGD: dict[str, Any] = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}
ADAMW: dict[str, Any] = {"name": "adamw", "lr": 0.01, "weight_decay": 0.5}
TOPK = {"method": "TopK", "k": 40}
RANDOMK = {"method": "RandomK", "k": 40}
QUANT = {"method": "Quantization", "bits": 4}
EF_RANDOMK = {"method": "ErrorFeedback", "error_compensation": True, "base_strategy": RANDOMK}
DEAD = ("dead.weight", "dead.bias")


class Net(nn.Module):
    def __init__(self, num_classes: int, data_branch: bool, empty_param: bool = False) -> None:
        super().__init__()
        if empty_param:  # a child holding only an empty parameter (a device anchor, say)
            self.marker = nn.Module()
            self.marker.anchor = nn.Parameter(torch.empty(0))
        self.fc1 = nn.Linear(64, 16)
        self.rank_branch = nn.Linear(16, 16)
        self.data_branch = nn.Linear(16, 16)
        self.dead = nn.Linear(16, num_classes)
        self.head = nn.Linear(16, num_classes)
        self.use_data_branch = data_branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        h = torch.relu(self.fc1(x))
        if dist.is_initialized() and dist.get_rank() == 0:
            h = h + torch.tanh(self.rank_branch(h))
        if self.use_data_branch and float(x.mean()) > THRESHOLD:
            h = h + torch.tanh(self.data_branch(h))
        return self.head(h)


def make_net(*, input_shape: tuple[int, ...], num_classes: int, data_branch: bool = True,
             empty_param: bool = False) -> nn.Module:
    assert input_shape == (64,)
    return Net(num_classes, data_branch, empty_param)


def _job(tmp: str, name: str, aggregation: dict[str, Any], optimizer: dict[str, Any],
         compression: dict[str, Any] | None, data_branch: bool) -> Any:
    from paratrain.config import load_job

    doc: dict[str, Any] = {
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": 0},
        "model": {"factory": "test_dp_unused_params:make_net", "data_branch": data_branch},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": BATCH, "max_steps": STEPS, "optimizer": optimizer},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": aggregation},
    }
    if compression is not None:
        doc["compression"] = compression
    return load_job(doc)


def _state(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().reshape(-1).double().tolist() for n, p in model.named_parameters()}


def _ddp(ctx: WorkerContext, job: Any, hook: dict[str, Any] | None) -> dict[str, list[float]]:
    """torch DDP(find_unused_parameters=True) on the same shards, init and optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.comm.ddp_hook import ddp_hook
    from paratrain.data import load_data
    from paratrain.executors.data_parallel.runner import shard_indices
    from paratrain.models import build_model
    from paratrain.training import build_optimizer, seed_everything

    seed_everything(job.run.seed)
    bundle = load_data(job.data, seed=job.run.seed)
    x, y = bundle.train.tensors
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    ddp = DDP(model, find_unused_parameters=True)
    if hook is not None:
        state, fn = ddp_hook(hook, model=ddp, seed=job.run.seed)
        ddp.register_comm_hook(state, fn)
    opt = build_optimizer(ddp.parameters(), job.train.optimizer)
    idx = shard_indices(len(y), world=ctx.world_size, rank=ctx.rank, seed=job.run.seed, epoch=0)
    for b in range(STEPS):
        sel = idx[b * BATCH : (b + 1) * BATCH]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x[sel]), y[sel]).backward()
        opt.step()
    return _state(model)


def train_variants(ctx: WorkerContext, tmp: str, variants: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Each variant ``(name, aggregation | "DDP", optimizer, compression, data_branch)``:
    the final parameters by name; ``init`` holds the initial ones."""
    from paratrain.data import load_data
    from paratrain.executors.data_parallel.runner import train_replica
    from paratrain.models import build_model
    from paratrain.training import seed_everything

    out: dict[str, Any] = {}
    for name, agg, opt, comp, data_branch in variants:
        job = _job(tmp, name, agg if isinstance(agg, dict) else {"method": "AllReduce"}, opt, comp,
                   data_branch)
        if "init" not in out:
            seed_everything(SEED)
            bundle = load_data(job.data, seed=SEED)
            out["init"] = _state(build_model(job.model, input_shape=bundle.input_shape,
                                             num_classes=bundle.num_classes))
        if agg == "DDP":
            out[name] = _ddp(ctx, job, comp)
        else:
            model, _ = train_replica(ctx, job, False, plot=False)
            out[name] = _state(model)
    return out


def _data_branch_users() -> list[int]:
    """How many of the 2 ranks call ``data_branch`` at each step."""
    from paratrain.config import load_job
    from paratrain.data import load_data
    from paratrain.executors.data_parallel.runner import shard_indices

    job = load_job({"run": {"name": "x", "seed": SEED}, "data": {"name": "digits"}})
    x, y = load_data(job.data, seed=SEED).train.tensors
    shards = [shard_indices(len(y), world=2, rank=r, seed=SEED, epoch=0) for r in range(2)]
    return [sum(float(x[s[b * BATCH : (b + 1) * BATCH]].mean()) > THRESHOLD for s in shards)
            for b in range(STEPS)]


AR = {"method": "AllReduce"}
PS = {"method": "ParameterServer"}
COMPLETE = {"method": "Decentralized", "topology": "complete"}
RING = {"method": "Decentralized", "topology": "ring"}

# (name, aggregation, optimizer, compression, data_branch), reference name or None.
CASES: list[tuple[tuple[Any, ...], str | None]] = [
    (("ddp_sgd", "DDP", SGD, None, True), None),
    (("ddp_adamw", "DDP", ADAMW, None, True), None),
    (("ddp_topk_sgd", "DDP", SGD, TOPK, True), None),
    (("ddp_randomk_adamw", "DDP", ADAMW, RANDOMK, True), None),
    (("ddp_quant_sgd", "DDP", SGD, QUANT, True), None),
    # ErrorFeedback keeps residuals; DDP's hook also compresses (and so spends) the
    # residual of a layer nobody used this step, which paratrain leaves for later, so
    # that comparison runs without the data-dependent branch.
    (("ddp_ef_sgd", "DDP", SGD, EF_RANDOMK, False), None),
    (("allreduce_sgd", AR, SGD, None, True), "ddp_sgd"),
    (("allreduce_adamw", AR, ADAMW, None, True), "ddp_adamw"),
    (("ps_sgd", PS, SGD, None, True), "ddp_sgd"),
    (("ps_adamw", PS, ADAMW, None, True), "ddp_adamw"),
    (("allreduce_topk_sgd", AR, SGD, TOPK, True), "ddp_topk_sgd"),
    (("allreduce_randomk_adamw", AR, ADAMW, RANDOMK, True), "ddp_randomk_adamw"),
    (("allreduce_quant_sgd", AR, SGD, QUANT, True), "ddp_quant_sgd"),
    (("allreduce_ef_sgd", AR, SGD, EF_RANDOMK, False), "ddp_ef_sgd"),
    # No DDP counterpart (the server's own gradient is not compressed; gossip is not
    # gradient averaging): the dead layer must still stay put.
    (("ps_topk_sgd", PS, SGD, TOPK, True), None),
    (("gossip_sgd", COMPLETE, SGD, None, True), None),
    (("gossip_adamw", RING, ADAMW, None, True), None),
    (("choco_topk_sgd", RING, SGD, TOPK, True), None),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("unused")
    return run_distributed(train_variants, 2, str(tmp), [c for c, _ in CASES], timeout_s=240)


def _t(v: list[float]) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def test_branch_pattern_covers_one_both_and_neither() -> None:
    users = _data_branch_users()
    assert 1 in users and 2 in users
    # A step where nobody uses it right after one where somebody did (momentum would move it).
    assert any(a > 0 and b == 0 for a, b in zip(users, users[1:], strict=False))


@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[c[0] for c, _ in CASES])
def test_dead_layer_does_not_move(results: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    name = case[0]
    for r in results:
        for p in DEAD:
            assert torch.equal(_t(r[name][p]), _t(r["init"][p])), f"{name}: {p} moved on a rank"


@pytest.mark.parametrize("case,ref", [c for c in CASES if c[1] is not None],
                         ids=[c[0][0] for c in CASES if c[1] is not None])
def test_matches_ddp_find_unused_parameters(results: list[dict[str, Any]], case: tuple[Any, ...],
                                            ref: str) -> None:
    name = case[0]
    for r in results:
        for p, v in r[ref].items():
            torch.testing.assert_close(_t(r[name][p]), _t(v), rtol=1e-6, atol=1e-7,
                                       msg=f"{name} vs {ref}: {p} differs")
    # Not vacuous: the branch only rank 0 runs was trained (with half its gradient) on both.
    moved = _t(results[0][name]["rank_branch.weight"]) - _t(results[0]["init"]["rank_branch.weight"])
    assert moved.abs().max() > 1e-4
    torch.testing.assert_close(_t(results[1][name]["rank_branch.weight"]),
                               _t(results[0][name]["rank_branch.weight"]), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["ps_topk_sgd", "gossip_sgd"])
def test_replicas_agree_without_ddp_counterpart(results: list[dict[str, Any]], name: str) -> None:
    for p, v in results[0][name].items():
        torch.testing.assert_close(_t(results[1][name][p]), _t(v), rtol=1e-6, atol=1e-7)


def test_weight_decay_would_move_an_unused_layer_with_a_zero_gradient() -> None:
    """The failure the rule prevents: a zero (instead of absent) gradient lets momentum
    and weight decay move a layer nobody used."""
    for spec in (SGD, ADAMW):
        layer = nn.Linear(4, 3)
        before = layer.weight.detach().clone()
        opt = (torch.optim.SGD if spec["name"] == "sgd" else torch.optim.AdamW)(
            layer.parameters(), **{k: v for k, v in spec.items() if k != "name"})
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        assert not torch.equal(layer.weight.detach(), before)


# ------------------------------------------------------------------ tensor parallel x DP


class TPNet(nn.Module):
    """``body`` = fc0 -> GELU -> fc1 (sharded column/row), plus ``dead`` (never called)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 30), nn.GELU(), nn.Linear(30, 12))
        self.dead = nn.Linear(30, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def tp_dp_dead_layer(ctx: WorkerContext) -> dict[bool, dict[str, float]]:
    """tp = 2 x dp = 2, 3 SGD (momentum + weight decay) steps of 2 micro-batches, with and
    without gradient accumulation: each must equal dense SGD on the whole batch, with the
    dead layer untouched."""
    import copy

    from _workers_tp import engine_step
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.config import TensorParallelismConfig
    from paratrain.tensor_parallel import parallelize

    torch.manual_seed(0)
    dense = TPNet()
    init = {k: v.clone() for k, v in dense.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 12, (16,), generator=g)
    groups = build_tp_groups(2)
    d = groups.tp_index
    opt_args = {k: v for k, v in SGD.items() if k != "name"}
    ref = copy.deepcopy(dense)
    ropt = torch.optim.SGD(ref.parameters(), **opt_args)
    for _ in range(3):
        ropt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ref(x), y).backward()
        ropt.step()
    out: dict[bool, dict[str, float]] = {}
    for accumulate in (True, False):
        conf = TensorParallelismConfig(tensor_parallel_size=2, memory_optimization="None",
                                       gradient_accumulation=accumulate)
        tpm = parallelize(copy.deepcopy(dense), conf, groups)
        opt = torch.optim.SGD(tpm.parameters(), **opt_args)
        for _ in range(3):
            engine_step(tpm, x[d * 8 : (d + 1) * 8], y[d * 8 : (d + 1) * 8], opt, micro_batches=2)
        full = tpm.dense_state_dict()
        out[accumulate] = {
            "live_diff": max(float((full[k] - p.detach()).abs().max())
                             for k, p in ref.named_parameters() if not k.startswith("dead")),
            "dead_moved": max(float((full[k] - init[k]).abs().max()) for k in DEAD),
            "live_moved": float((full["body.0.weight"] - init["body.0.weight"]).abs().max()),
        }
    return out


def test_tensor_parallel_x_dp_leaves_the_dead_layer() -> None:
    for r in run_distributed(tp_dp_dead_layer, 4, timeout_s=200):
        for accumulate, res in r.items():
            assert res["dead_moved"] == 0.0, f"gradient_accumulation={accumulate}"
            assert res["live_moved"] > 1e-3
            assert res["live_diff"] < 1e-5
