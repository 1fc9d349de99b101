"""SCAFFOLD (Karimireddy et al. 2020, option II) and FedNova (Wang et al. 2020) on the local
Federated path, in one process: the runner's global model, server control variate and
clients' control variates against a hand-written reference of each paper's algorithm on a
small problem (4 clients of unequal size, a 64-16-10 MLP, mini-batch SGD, 3 rounds with
client sampling); the reductions to FedAvg (SCAFFOLD's first round from c = 0; FedNova with
equal local step counts) with their non-vacuity; the unsupported combinations named."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_federated import fed_job
from paratrain.config import ConfigError
from paratrain.config.strategy import dump_strategy, load_strategy
from paratrain.data.partition import partition_dataset
from paratrain.executors.federated import run
from paratrain.executors.federated.client import client_generator
from paratrain.executors.federated.selection import select_clients
from paratrain.models.state import unique_state_dict
from paratrain.task import resolve_task
from paratrain.task.steps import call_model, fetch_batch
from paratrain.training import seed_everything
from paratrain.training.stores import read_rank_state

pytestmark = pytest.mark.timeout(120)

K, ROUNDS, LR, EPOCHS, BATCH = 4, 3, 0.05, 2, 64
SEL = {"method": "Random", "fraction": 0.75}  # 3 of 4 clients a round: |S|/N = 3/4
DIRICHLET = {"method": "dirichlet", "alpha": 0.5, "min_size": 30}  # unequal sizes and label mixes


def _job(tmp: Path, name: str, agg: dict[str, Any], **kw: Any) -> Any:
    kw.setdefault("lr", LR)
    return fed_job(tmp, name, K=K, rounds=kw.pop("rounds", ROUNDS), agg=agg, sel=kw.pop("sel", SEL),
                   partition=kw.pop("partition", DIRICHLET), hidden=16,
                   local_epochs=kw.pop("local_epochs", EPOCHS), batch_size=kw.pop("batch_size", BATCH), **kw)


def _state(run_dir: str, round_: int) -> dict[str, Any]:
    return read_rank_state(Path(run_dir) / "checkpoints" / f"step-{round_:09d}", 0)


def _server(run_dir: str, round_: int) -> dict[str, Any]:
    """The server's state after ``round_`` rounds (what ``server.state_dict()`` holds)."""
    st = _state(run_dir, round_)
    return {**st["engine"]["server"], "model": st["model"]}


def _reference(job: Any, *, method: str, server_lr: float = 1.0, momentum: float = 0.0) -> dict[str, Any]:
    """The paper's algorithm written out: the same model, data, partition, client sampling
    and mini-batch order as the runner (those are not what is tested), the algorithm in
    float64 on the server and float32 SGD steps on the clients."""
    seed, strat = job.run.seed, job.strategy
    seed_everything(seed)
    task = resolve_task(job)
    train, _ = task.datasets(seed)
    model = task.build_model(job.model, train)
    parts = partition_dataset(train, K, job.data.partition, seed=seed)
    x = {k: v.detach().double().clone() for k, v in unique_state_dict(model).items()}
    names = [n for n, _ in model.named_parameters()]
    c = {k: torch.zeros_like(v) for k, v in x.items()}
    c_i = {i: {k: torch.zeros_like(v) for k, v in x.items()} for i in range(K)}
    for r in range(ROUNDS):
        chosen = select_clients(strat.client_selection, num_clients=K, round_idx=r, seed=seed)
        dys, dcs, ns, norms = [], [], [], []
        for i in chosen:
            net = copy.deepcopy(model)
            net.load_state_dict({k: v.float() for k, v in x.items()})
            params = dict(net.named_parameters())
            corr = {n: (c[n] - c_i[i][n]).float() for n in names}
            buf = {n: torch.zeros_like(p) for n, p in params.items()}
            idx = torch.from_numpy(parts[i])
            gen = client_generator(seed, r, i)
            steps = 0
            for _ in range(EPOCHS):
                order = idx[torch.randperm(len(idx), generator=gen)]
                for a in range(0, len(idx), BATCH):
                    batch = fetch_batch(train, order[a : a + BATCH], None)
                    net.zero_grad()
                    task.loss(call_model(task, net, batch), batch).backward()
                    with torch.no_grad():
                        for n, p in params.items():
                            g = p.grad + corr[n] if method == "SCAFFOLD" else p.grad
                            buf[n] = momentum * buf[n] + g if momentum else g
                            p -= LR * buf[n]
                    steps += 1
            y = {k: v.detach().double() for k, v in unique_state_dict(net).items()}
            dys.append({k: y[k] - x[k] for k in x})
            ns.append(len(idx))
            if method == "SCAFFOLD":  # option II
                new = {k: c_i[i][k] - c[k] + (x[k] - y[k]) / (steps * LR) for k in x}
                dcs.append({k: new[k] - c_i[i][k] for k in x})
                c_i[i] = new
            else:  # FedNova's a_i, heavy-ball form
                rho = momentum
                norms.append(steps if rho == 0 else (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho))
        p = [n / sum(ns) for n in ns]
        if method == "SCAFFOLD":
            x = {k: x[k] + server_lr * sum(pi * d[k] for pi, d in zip(p, dys, strict=True)) for k in x}
            c = {k: c[k] + len(chosen) / K * sum(pi * d[k] for pi, d in zip(p, dcs, strict=True)) for k in x}
        else:
            tau_eff = sum(pi * a for pi, a in zip(p, norms, strict=True))
            d = [{k: -dy[k] / a for k in x} for dy, a in zip(dys, norms, strict=True)]
            x = {k: x[k] - tau_eff * sum(pi * di[k] for pi, di in zip(p, d, strict=True)) for k in x}
    return {"x": x, "c": c, "c_i": c_i, "parts": parts}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, tol: float = 2e-5) -> None:
    assert list(a) == list(b), what
    for k in a:
        err = float((a[k].double() - b[k].double()).abs().max())
        scale = float(b[k].double().abs().max()) + 1e-3
        assert err <= tol * scale, (what, k, err, scale)


def test_scaffold_matches_the_papers_algorithm(tmp_path: Path) -> None:
    job = _job(tmp_path, "scaffold", {"method": "SCAFFOLD", "server_lr": 0.7})
    out = run(job)
    ref = _reference(job, method="SCAFFOLD", server_lr=0.7)
    assert len({len(p) for p in ref["parts"]}) == K  # unequal client sizes: the weights matter
    state = _server(out["run_dir"], ROUNDS)
    _close(state["model"], ref["x"], "global model")
    _close(state["aggregator"]["control"], ref["c"], "server control variate c")
    saved = _state(out["run_dir"], ROUNDS)["engine"]["clients"]["control"]
    trained = sorted(int(n.removeprefix("client-")) for n in saved)
    assert trained, saved
    for i in trained:
        _close(saved[f"client-{i}"], ref["c_i"][i], f"client {i}'s control variate", tol=1e-4)
    assert float(sum(v.abs().sum() for v in ref["c"].values())) > 0  # c moved: non-vacuous
    # the uplink carries dc_i too: twice the update's bytes (both dense float32)
    model_bytes = sum(4 * v.numel() for v in state["model"].values())
    assert out["bytes_up_measured"] == 2 * model_bytes * out["client_updates_this_run"]


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_fednova_matches_the_papers_algorithm(tmp_path: Path, momentum: float) -> None:
    opt = {"name": "sgd", "lr": LR, **({"momentum": momentum} if momentum else {})}
    job = _job(tmp_path, "nova", {"method": "FedNova"})
    doc = job.to_json_dict()
    doc["train"]["optimizer"] = opt
    job = type(job).model_validate(doc)
    out = run(job)
    ref = _reference(job, method="FedNova", momentum=momentum)
    _close(_server(out["run_dir"], ROUNDS)["model"], ref["x"], "global model")
    # unequal local step counts (tau_i = E * ceil(n_i / B)), so this is not FedAvg
    assert len({-(-len(p) // BATCH) for p in ref["parts"]}) > 1
    avg = run(type(job).model_validate({**doc, "strategy": {**doc["strategy"], "aggregation": {"method": "FedAvg"}},
                                        "run": {**doc["run"], "name": "avg"}}))
    assert avg["parameters_sha256"] != out["parameters_sha256"]


def test_scaffold_first_round_is_fedavg_then_differs(tmp_path: Path) -> None:
    shards = {"method": "shards", "shards_per_client": 2}
    runs = {m: run(_job(tmp_path, m, {"method": m}, rounds=2, partition=shards, sel={"method": "All"}))
            for m in ("FedAvg", "SCAFFOLD")}
    first, second = ({m: _server(runs[m]["run_dir"], r)["model"] for m in runs} for r in (1, 2))
    # c = 0 and c_i = 0 in round 1: no correction, eta_g = 1 -> FedAvg's model bit for bit
    assert all(torch.equal(first["SCAFFOLD"][k], first["FedAvg"][k]) for k in first["FedAvg"])
    # round 2 uses the control variates of round 1
    assert not all(torch.equal(second["SCAFFOLD"][k], second["FedAvg"][k]) for k in second["FedAvg"])


def test_fednova_with_equal_local_steps_is_fedavg(tmp_path: Path) -> None:
    # whole-dataset batches: every client takes E steps whatever its size (unequal sizes)
    kw: dict[str, Any] = dict(batch_size=None, sel={"method": "All"})
    nova = run(_job(tmp_path, "nova", {"method": "FedNova"}, **kw))
    avg = run(_job(tmp_path, "avg", {"method": "FedAvg"}, **kw))
    a, b = _server(nova["run_dir"], ROUNDS)["model"], _server(avg["run_dir"], ROUNDS)["model"]
    # p_i * tau_eff / a_i = p_i up to the rounding of sum(p_i) = 1 in float64
    _close(a, b, "FedNova vs FedAvg", tol=1e-6)


def test_unsupported_combinations_name_the_field(tmp_path: Path) -> None:
    for agg, opt, field in [
        ("SCAFFOLD", {"name": "adam", "lr": 0.01}, "train.optimizer.name"),
        ("SCAFFOLD", {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "train.optimizer.momentum"),
        ("FedNova", {"name": "adamw", "lr": 0.01}, "train.optimizer.name"),
        ("FedNova", {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, "train.optimizer"),
    ]:
        doc = _job(tmp_path, "bad", {"method": agg}).to_json_dict()
        doc["train"]["optimizer"] = opt
        with pytest.raises(ConfigError) as err:
            run(type(_job(tmp_path, "x", {"method": "FedAvg"})).model_validate(doc))
        problems = dict(err.value.problems)
        assert field in problems and agg in problems[field], problems
    # the contract: both round-trip, SCAFFOLD's server_lr defaults to 1
    docs: list[dict[str, Any]] = [
        {"type": "Federated", "num_clients": 3, "rounds": 2, "aggregation": {"method": "SCAFFOLD"},
         "client_selection": {"method": "All"}},
        {"type": "Federated", "num_clients": 3, "rounds": 2, "aggregation": {"method": "FedNova"},
         "client_selection": {"method": "All"}}]
    for doc in docs:
        s = load_strategy(doc)
        assert dump_strategy(s)["aggregation"]["method"] == doc["aggregation"]["method"]
    assert load_strategy({**doc, "aggregation": {"method": "SCAFFOLD"}}).aggregation.server_lr == 1.0


def test_server_rejects_an_uplink_without_the_methods_extra() -> None:
    """A SCAFFOLD client that sends no control delta, or a FedNova client no normaliser, is a
    recorded failure naming the client and what is missing; the others are aggregated."""
    from paratrain.config.federated_aggregation import SCAFFOLD, FedNova
    from paratrain.executors.federated.drift import pack_control
    from paratrain.executors.federated.server import FederatedServer
    from paratrain.executors.federated.wire import encode_update

    g = {"w": torch.zeros(3), "b": torch.zeros(())}
    delta = {"w": torch.ones(3), "b": torch.tensor(0.5)}
    h, p = encode_update(delta)
    hc, pc = encode_update(pack_control({k: v * 2 for k, v in delta.items()}))
    server = FederatedServer(SCAFFOLD(), g, num_clients=4)
    rec = server.finish_round(0, [{"client": 0, "ok": True, "n": 5, "headers": h + hc, "steps": 2},
                                  {"client": 1, "ok": True, "n": 5, "headers": h, "steps": 2}], [p + pc, p])
    assert rec["clients_ok"] == 1 and "client-1" in rec["failures"][0]["client"]
    assert "scaffold.dc/" in rec["failures"][0]["error"]
    assert torch.equal(server.global_state["w"], torch.ones(3))
    assert torch.equal(server.control()["w"], torch.full((3,), 0.5))  # c += (1/4) * dc
    nova = FederatedServer(FedNova(), g)
    rec = nova.finish_round(0, [{"client": 0, "ok": True, "n": 5, "headers": h, "steps": 2, "norm": 2.0},
                                {"client": 1, "ok": True, "n": 5, "headers": h, "steps": 2}], [p, p])
    assert rec["clients_ok"] == 1 and "<norm>" in rec["failures"][0]["error"]
