"""Federated trains any Task: regression, the language model over the speaker partition
(one client per speaking role), a client step that is the one loop's step, and a
bit-identical resume with clipping + accumulation + bf16 + a cosine schedule over rounds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import paratrain
from paratrain.config.job import load_job
from paratrain.data.partition import partition_dataset
from paratrain.executors.federated import run_in_process
from paratrain.executors.federated.client import ClientHost, client_generator
from paratrain.executors.federated.selection import num_random
from paratrain.executors.federated.state import fed_store
from paratrain.task import evaluate, resolve_task
from paratrain.training import build_optimizer, read_metrics, seed_everything
from paratrain.training.faults import FAULT_ENV
from paratrain.training.loop import DataPlan, LocalEngine, LoopRun, Trainer, run_loop
from paratrain.training.stepping import build_scheduler
from paratrain.training.stores import LocalStore, read_rank_state

TINY_GPT = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 2}


def _rounds(run_dir: str) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "round" in r]


def _regression(out: Path, name: str, **kw: Any) -> dict[str, Any]:
    train = {"optimizer": {"name": "adam", "lr": 3e-3, "weight_decay": 0.01}, **kw.pop("train", {})}
    return {
        "run": {"name": name, "seed": 0, "output_dir": str(out), "num_workers": 1},
        "task": {"name": "regression"}, "data": {"name": "diabetes"},
        "model": {"name": "mlp", "hidden": [16]}, "train": train,
        "strategy": {"type": "Federated", "num_clients": kw.pop("K", 6), "rounds": kw.pop("rounds", 4),
                     "aggregation": {"method": "FedAvg"},
                     "client_selection": kw.pop("sel", {"method": "Random", "fraction": 0.5})},
        "federated": {"local_epochs": 2, "batch_size": 8, **kw},
    }


def _initial_metrics(doc: dict[str, Any]) -> dict[str, float]:
    """The test metrics of the model every run starts from (round 0)."""
    job = load_job(doc)
    seed_everything(job.run.seed)
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    return evaluate(task.build_model(job.model, train), task, test)


def test_regression_federated_reports_task_metrics_and_learns(tmp_path: Path) -> None:
    doc = _regression(tmp_path, "reg", rounds=4)
    s = run_in_process(load_job(doc))
    assert s["task"] == "regression" and s["rounds"] == 4
    for key in ("test_loss", "test_mse", "test_r2", "best_test_mse"):
        assert isinstance(s[key], float), key
    assert "test_accuracy" not in s and s["test_loss"] == s["test_mse"]
    recs = _rounds(s["run_dir"])
    assert [r["round"] for r in recs] == [1, 2, 3, 4]
    assert all({"test_mse", "test_r2", "test_loss", "train_loss"} <= set(r) for r in recs)
    assert s["best_test_mse"] == min(r["test_mse"] for r in recs)
    start = _initial_metrics(doc)
    assert s["test_mse"] < 0.9 * start["mse"], (start, s["test_mse"])
    assert s["test_mse"] < recs[0]["test_mse"] and s["test_r2"] > start["r2"]


def test_language_model_speaker_partition_one_client_per_role(tmp_path: Path) -> None:
    """LEAF Shakespeare: as many clients as speaking roles (> 1,000 here), 0.5% of them per
    round; through ``paratrain.fit`` (preflight included)."""
    task_doc = {"name": "language_model", "block_size": 16, "stride": 64}
    data = {"name": "shakespeare", "test_every": 38, "partition": {"method": "speaker"}}
    probe = load_job({"task": task_doc, "data": data, "model": TINY_GPT})
    train, _ = resolve_task(probe).datasets(0)
    speakers = np.asarray(train.speakers)
    roles = np.unique(speakers)
    k = len(roles)
    assert k >= 100
    # each speaking role is exactly one client's data, all of it
    parts = partition_dataset(train, k, probe.data.partition, seed=0)
    assert sum(len(p) for p in parts) == len(train)
    owners = {int(np.unique(speakers[p])[0]) for p in parts if len(np.unique(speakers[p])) == 1}
    assert len(owners) == k
    with pytest.raises(ValueError, match="only .* speakers"):
        partition_dataset(train, k + 1, probe.data.partition, seed=0)
    frac = 0.005
    doc = {
        "run": {"name": "lm", "seed": 0, "output_dir": str(tmp_path), "num_workers": 1},
        "task": task_doc, "data": data, "model": TINY_GPT,
        "train": {"optimizer": {"name": "adamw", "lr": 3e-3}},
        "strategy": {"type": "Federated", "num_clients": k, "rounds": 3,
                     "aggregation": {"method": "FedAvg"},
                     "client_selection": {"method": "Random", "fraction": frac}},
        "federated": {"local_epochs": 2, "batch_size": 16},
    }
    s = paratrain.fit(doc)
    assert s["task"] == "language_model" and s["num_clients"] == k
    for key in ("test_loss", "test_perplexity", "test_bits_per_token", "best_test_loss",
                "bigram_test_loss"):
        assert isinstance(s[key], float), key
    assert s["test_perplexity"] == pytest.approx(np.exp(s["test_loss"]))
    recs = _rounds(s["run_dir"])
    assert [r["round"] for r in recs] == [1, 2, 3]
    assert all(r["clients_selected"] == num_random(frac, k) == r["clients_ok"] for r in recs)
    assert all("test_perplexity" in r for r in recs)
    start = _initial_metrics(doc)
    assert s["test_loss"] < recs[0]["test_loss"] < start["loss"] - 0.1, (start, recs)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_client_step_is_the_loops_step(tmp_path: Path, precision: str) -> None:
    """1 client, All, FedAvg, 1 round: the client's local training equals the one loop
    (Local's Trainer + LocalEngine + run_loop) over the same steps and data order, bit for
    bit; the global model after the round equals it to float32 rounding (the server
    computes ``w + n*D/n`` with ``D = w_local - w`` in float64, not ``w_local`` itself).
    The *order* is the one thing Local does differently: a client shuffles with
    ``randperm(n, client_generator(seed, round, client))``, Local with
    ``epoch_permutation(n, seed, epoch)``, so a real Local run walks other batches."""
    train_cfg = {"optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.05},
                 "grad_clip_norm": 0.5, "grad_accumulation": 2, "precision": precision}
    doc = _regression(tmp_path, f"one-{precision}", K=1, rounds=1, sel={"method": "All"}, train=train_cfg,
                      local_epochs=3, batch_size=24)
    job = load_job(doc)
    seed_everything(0)
    task = resolve_task(job)
    train, test = task.datasets(0)
    net = task.build_model(job.model, train)
    g0 = {k: v.detach().clone() for k, v in net.state_dict().items()}
    # the federated client, through the executor's own host
    (part,) = partition_dataset(train, 1, job.data.partition, seed=0)
    host = ClientHost(job, rank=0, world_size=1, model=net, task=task, dataset=train, partitions=[part])
    res = host.train_one(0, 0, g0)
    assert res.ok, res.error
    client = {k: v.detach().clone() for k, v in net.state_dict().items()}

    def local(order_of: Any, accumulation: int = 2) -> dict[str, torch.Tensor]:
        ref = task.build_model(job.model, train)
        ref.load_state_dict(g0)
        t = job.train.model_copy(update={"grad_accumulation": accumulation})
        plan = DataPlan(dataset=train, order=order_of, examples_per_epoch=len(part), batch_size=24,
                        accumulation=accumulation, epochs=3, max_steps=None)
        opt = build_optimizer(ref.parameters(), t.optimizer)
        trainer = Trainer(LocalEngine(ref, task, test, device=torch.device("cpu"), precision=precision),
                          opt, t, plan.total_steps, scheduler=build_scheduler(opt, t, plan.total_steps))
        store = LocalStore(tmp_path / f"local-{accumulation}-{id(order_of)}")
        run_loop(LoopRun(trainer=trainer, plan=plan, task=task, store=store, label="ref", metrics=None,
                         resume=False))
        return {k: v.detach().clone() for k, v in ref.state_dict().items()}

    gen = client_generator(0, 0, 0)
    perms = [torch.from_numpy(part)[torch.randperm(len(part), generator=gen)] for _ in range(3)]
    same = local(lambda e: perms[e])
    assert all(torch.equal(client[k], same[k]) for k in client)
    # non-vacuity: another accumulation, or Local's own order, gives other weights
    other = local(lambda e: perms[e], accumulation=1)
    assert not all(torch.equal(client[k], other[k]) for k in client)
    from paratrain.training.loop import epoch_permutation

    own = local(lambda e: epoch_permutation(len(part), seed=0, epoch=e))
    assert not all(torch.allclose(client[k], own[k]) for k in client)
    # the whole federated run: the global model after the round is the client's
    s = run_in_process(job)
    ck = read_rank_state(Path(s["run_dir"]) / "checkpoints" / "step-000000001", 0)
    for k in client:
        torch.testing.assert_close(ck["model"][k], client[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(client["fc0.weight"], g0["fc0.weight"])


_KILLED = """
import json, sys
from paratrain.config.job import load_job
from paratrain.executors.federated import run_in_process
run_in_process(load_job(json.loads(sys.argv[1])))
"""


def test_killed_run_resumes_bit_identical_with_clip_accumulation_bf16_cosine(tmp_path: Path) -> None:
    train_cfg = {"grad_clip_norm": 0.5, "grad_accumulation": 2, "precision": "bf16",
                 "lr_schedule": "cosine", "warmup_steps": 1}
    ref = run_in_process(load_job(_regression(tmp_path / "ref", "r", train=train_cfg)))
    scales = [r["lr_scale"] for r in _rounds(ref["run_dir"])]
    # warm-up over round 0, then half a cosine over the remaining rounds (T = rounds = 4)
    assert scales == pytest.approx([1.0, 1.0, 0.75, 0.25])
    doc = _regression(tmp_path / "kill", "r", train=train_cfg)
    # the process is SIGKILLed after round 2 (and round 2's checkpoint)
    proc = subprocess.run([sys.executable, "-c", _KILLED, json.dumps(doc)], capture_output=True,
                          env={**os.environ, FAULT_ENV: "0:2"}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    run_dir = tmp_path / "kill" / "r"
    assert [r["round"] for r in _rounds(str(run_dir))] == [1, 2]
    shutil.copytree(run_dir, tmp_path / "bad" / "r")
    resumed = run_in_process(load_job(doc), resume=True)
    assert resumed["parameters_sha256"] == ref["parameters_sha256"]
    assert [r["round"] for r in _rounds(resumed["run_dir"])] == [1, 2, 3, 4]
    assert [r["lr_scale"] for r in _rounds(resumed["run_dir"])] == scales
    # non-vacuity: the clients' schedule position in the server checkpoint is what the
    # resumed rounds use (rewind it and the run ends elsewhere)
    ck = tmp_path / "bad" / "r" / "checkpoints" / "step-000000002"
    state = read_rank_state(ck, 0)
    server = state["engine"]["server"]
    assert server["client_schedule"]["position"] == 2
    server["client_schedule"]["position"] = 0
    runtime = json.loads((ck / "layout.json").read_text())["runtime"]
    fed_store(tmp_path / "bad" / "r", rank=0, world=1, group=None, runtime=runtime).save(2, state)
    bad = run_in_process(load_job(_regression(tmp_path / "bad", "r", train=train_cfg)), resume=True)
    assert bad["parameters_sha256"] != ref["parameters_sha256"]


def test_partitions_and_target_accuracy_a_task_cannot_use_name_the_field(tmp_path: Path) -> None:
    from paratrain.config import ConfigError
    from paratrain.preflight import preflight

    fed = {"type": "Federated", "num_clients": 4, "rounds": 1, "aggregation": {"method": "FedAvg"},
           "client_selection": {"method": "All"}}
    cases = [
        ({"data": {"partition": {"method": "speaker"}}}, "data.partition", "has no speakers"),
        ({**_regression(tmp_path, "s"), "data": {"name": "diabetes", "partition": {"method": "shards"}}},
         "data.partition", "splits by class label"),
        ({**_regression(tmp_path, "t"), "federated": {"target_accuracy": 0.9}},
         "federated.target_accuracy", "no accuracy metric"),
    ]
    for doc, field, words in cases:
        job = load_job({"run": {"name": "x", "output_dir": str(tmp_path)}, **doc, "strategy": fed})
        with pytest.raises(ConfigError, match=words) as e:
            preflight(job, warn=False)
        assert e.value.problems[0][0] == field
        with pytest.raises(ConfigError, match=words):
            run_in_process(job)
    assert not (tmp_path / "x").exists()
