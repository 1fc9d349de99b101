"""The federated round's fast paths give what the plain ones give, bit for bit: a client's
update from the host's one reused optimizer (``FreshOptimizer``, plain SGD stepped by
``_PlainSGD``), its epoch gathered at once and its dense update encoded as one vector, against
a new optimizer with a constant ``LambdaLR`` per client, per-batch ``fetch_batch`` and
``encode_update`` per tensor; the server's one-pass decoding against the checked one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.config.job import load_job
from paratrain.data.partition import partition_dataset
from paratrain.executors.federated.aggregation import MalformedUpdateError
from paratrain.executors.federated.client import (
    ClientEngine,
    ClientHost,
    FreshOptimizer,
    client_generator,
)
from paratrain.executors.federated.wire import UpdateDecoder, decode_update, encode_update
from paratrain.models.state import load_unique_state_dict, unique_state_dict
from paratrain.task import resolve_task
from paratrain.task.steps import fetch_batch
from paratrain.training import build_optimizer, seed_everything
from paratrain.training.loop import Trainer

OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.1},
    "sgd_momentum_wd": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    "adam": {"name": "adam", "lr": 1e-2},
}


def _job(tmp: Path, optimizer: dict[str, Any], **train: Any) -> Any:
    return load_job({
        "run": {"name": "fast", "seed": 0, "output_dir": str(tmp), "num_workers": 1},
        "model": {"name": "mlp", "hidden": [16]}, "data": {"partition": {"method": "iid"}},
        "train": {"optimizer": optimizer, **train},
        "strategy": {"type": "Federated", "num_clients": 6, "rounds": 3,
                     "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}},
        "federated": {"local_epochs": 2, "batch_size": 10},
    })


def _reference(job: Any, task: Any, train: Any, model: Any, part: Any, g: dict[str, torch.Tensor],
               round_idx: int, client: int, lr_scale: float) -> tuple[list[dict[str, Any]], bytes]:
    """A client's round as it was written before the fast paths: a new optimizer and
    ``LambdaLR``, ``fetch_batch`` per batch, ``encode_update`` of the per-tensor deltas."""
    load_unique_state_dict(model, g)
    engine = ClientEngine(model, task, device=torch.device("cpu"))
    opt = build_optimizer(model.parameters(), job.train.optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: lr_scale)
    trainer = Trainer(engine, opt, job.train, 0, scheduler=sched)
    idx = torch.from_numpy(part)
    n, bs, acc = len(idx), job.federated.batch_size, job.train.grad_accumulation
    gen = client_generator(job.run.seed, round_idx, client)
    starts = list(range(0, n, bs))
    model.train()
    for _ in range(job.federated.local_epochs):
        order = idx[torch.randperm(n, generator=gen)]
        for s in range(0, len(starts), acc):
            trainer.step([fetch_batch(train, order[a : a + bs], torch.device("cpu"))
                          for a in starts[s : s + acc]])
    local = unique_state_dict(model)
    return encode_update({k: (local[k].detach().float() - v.float()).cpu() for k, v in g.items()})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("accumulation", [1, 2])
def test_client_update_is_the_plain_paths(tmp_path: Path, name: str, accumulation: int) -> None:
    job = _job(tmp_path, OPTIMIZERS[name], grad_accumulation=accumulation)
    seed_everything(0)
    task = resolve_task(job)
    train, _ = task.datasets(0)
    model = task.build_model(job.model, train)
    ref_model = task.build_model(job.model, train)
    parts = partition_dataset(train, 6, job.data.partition, seed=0)
    host = ClientHost(job, rank=1, world_size=2, model=model, task=task, dataset=train, partitions=parts)
    g = {k: v.detach().clone() for k, v in unique_state_dict(model).items()}
    for r, scale in enumerate([1.0, 0.5, 0.25]):
        for c in host.hosted:
            got = host.train_one(c, r, g, scale)
            assert got.ok, got.error
            headers, payload = _reference(job, task, train, ref_model, parts[c], g, r, c, scale)
            assert got.headers == headers and got.payload == payload, (name, r, c)
        g = {k: v + 0.01 for k, v in g.items()}  # a new global model: the cached vector is not reused
    assert (type(host.optimizer.fresh(1.0)).__name__ == "_PlainSGD") == (name == "sgd")


def test_plain_sgd_leaves_hooks_and_sparse_gradients_to_torch() -> None:
    """A global optimizer hook still runs (torch's own step), and the step equals SGD's."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    fresh = FreshOptimizer(net.parameters(), load_job({
        "strategy": {"type": "Local"}, "train": {"optimizer": {"name": "sgd", "lr": 0.1}}}).train.optimizer)
    opt = fresh.fresh(2.0)
    assert opt.param_groups[0]["lr"] == 0.1 * 2.0
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(net.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1 * 2.0)
    seen: list[Any] = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(o))
    try:
        for hooked in (True, False):
            if not hooked:
                handle.remove()
            x = torch.randn(5, 4)
            for m, o in ((net, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
            assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters(), strict=True))
    finally:
        handle.remove()
    assert fresh.optimizer in seen and len(seen) == 2  # hooked: ours through torch's step, and ref's


def _update(g: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], bytes]:
    return encode_update({k: torch.randn_like(v.float()) for k, v in g.items()})


def test_decode_in_one_pass_equals_the_checked_decode() -> None:
    torch.manual_seed(0)
    g = {"a": torch.zeros(3, 4), "b": torch.zeros(5), "n": torch.zeros((), dtype=torch.int64),
         "e": torch.zeros(0, 2)}
    headers, payload = _update(g)
    fast = decode_update("c", json.loads(json.dumps(headers)), payload, g)
    slow = decode_update("c", tuple(headers), payload, g)  # not a list: the checked path
    assert list(fast) == list(g) and all(torch.equal(fast[k], slow[k]) for k in g)
    assert all(fast[k].shape == g[k].shape and fast[k].dtype == torch.float32 for k in g)
    # what the one pass does not take gets the checked path's error
    nan = bytearray(payload)
    nan[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(MalformedUpdateError, match="'a'.*NaN"):
        decode_update("c", headers, bytes(nan), g)
    float_count = [dict(h) for h in headers]
    float_count[1]["nbytes"] = float(float_count[1]["nbytes"])
    with pytest.raises(MalformedUpdateError, match="'b'.*bad byte count"):
        decode_update("c", float_count, payload, g)
    swapped = [headers[1], headers[0], *headers[2:]]
    swapped_payload = payload[48:68] + payload[:48] + payload[68:]
    out = decode_update("c", swapped, swapped_payload, g)  # another order: checked, still decoded
    assert all(torch.equal(out[k], fast[k]) for k in g)
    with pytest.raises(MalformedUpdateError, match="headers announce"):
        decode_update("c", headers, payload[:-4], g)


def test_fedavg_of_decoded_updates_adds_each_as_one_vector_with_the_same_sums() -> None:
    from paratrain.executors.federated.aggregation._common import FlatUpdate
    from paratrain.executors.federated.aggregation.fedavg import fedavg_step

    torch.manual_seed(0)
    g = {"w": torch.zeros(33, 7), "b": torch.zeros(7), "e": torch.zeros(0), "n": torch.zeros((), dtype=torch.int64)}
    decode = UpdateDecoder(g)  # one round's: its updates share one layout
    ups = [decode("c", *_update(g)) for _ in range(23)]
    weights = [float(i % 5 + 1) for i in range(23)]
    assert all(isinstance(u, FlatUpdate) and u.layout is decode.layout for u in ups)
    apart = [{k: v.clone() for k, v in u.items()} for u in ups]  # separate tensors: per key
    a, b = fedavg_step(ups, weights), fedavg_step(apart, weights)
    assert all(a[k].shape == g[k].shape and a[k].dtype == torch.float64 and torch.equal(a[k], b[k]) for k in g)
    # a mixed round (one update decoded against another layout) takes the per-key sums
    h, p = _update(g)
    mixed = fedavg_step([decode_update("c", h, p, g), *ups[1:]], weights)
    flat = fedavg_step([decode("c", h, p), *ups[1:]], weights)
    assert all(torch.equal(mixed[k], flat[k]) for k in g) and not torch.equal(mixed["w"], a["w"])
