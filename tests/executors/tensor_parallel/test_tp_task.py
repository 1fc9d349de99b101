"""Tensor parallelism trains any Task through the one loop (TensorParallelEngine):

- parity: on the same batch, TP=2's loss, gathered gradients and whole-model gradient norm
  equal Local's (one process, dense model) to rtol 1e-5 in fp32, for regression (diabetes,
  an MLP) and a tiny GPT language model, with micro-batches and the sequence-parallel
  layout too; a wrong loss reduction (sum instead of mean) fails the same comparison;
- resume: a TP=2 run with a cosine schedule + warmup, clipping, accumulation 2 and bf16,
  whose rank 1 is SIGKILLed after step 3 (``PARATRAIN_FAULT_KILL``) and restarted by the
  elastic agent from its checkpoint, ends with the uninterrupted run's parameters_sha256.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError, TensorParallelismConfig, load_job
from paratrain.data.shakespeare import CharBlocks, load_corpus
from paratrain.task import fetch_batch, resolve_task
from paratrain.training.export import read_model

HERE = Path(__file__).resolve().parent


def tiny_lm_data(*, seed: int, block_size: int) -> tuple[CharBlocks, CharBlocks]:
    """A slice of the shakespeare corpus (a language_model data.factory): fast tests."""
    del seed
    c = load_corpus()
    kw = {"block_size": block_size, "vocab": c.vocab}
    return CharBlocks(c.train[:8_000], **kw), CharBlocks(c.test[:1_500], **kw)


def _doc(kind: str, out: str, name: str) -> dict[str, Any]:
    if kind == "regression":
        return {"run": {"name": name, "seed": 5, "output_dir": out},
                "task": {"name": "regression"}, "data": {"name": "diabetes"},
                "model": {"name": "mlp", "hidden": [16, 16]},
                "train": {"batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05}}}
    return {"run": {"name": name, "seed": 2, "output_dir": out},
            "task": {"name": "language_model", "block_size": 16},
            "data": {"factory": "test_tp_task:tiny_lm_data"},
            "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32},
            "train": {"batch_size": 8, "optimizer": {"name": "adamw", "lr": 3e-3}}}


class _SumLoss:
    """The task with a wrong reduction: the sum over the batch instead of the mean."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        return self.task.loss(output, batch) * batch[0].shape[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)


def _tp_side(kind: str, out: str, tp_conf: dict[str, Any], wrong: bool) -> dict[str, Any]:
    """This rank's TP engine on the first batch: loss, gathered gradients, grad norm."""
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.executors.tensor_parallel.engine import TensorParallelEngine
    from paratrain.tensor_parallel import parallelize
    from paratrain.training import seed_everything

    job = load_job(_doc(kind, out, "parity"))
    seed_everything(job.run.seed)
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    model = task.build_model(job.model, train)
    conf = TensorParallelismConfig(tensor_parallel_size=2, **tp_conf)
    groups = build_tp_groups(2, pattern=conf.communication_pattern.value)
    tpm = parallelize(copy.deepcopy(model), conf, groups)
    eng = TensorParallelEngine(tpm, _SumLoss(task) if wrong else task, test,
                               device=torch.device("cpu"), micro_batches=conf.micro_batches)
    batch = fetch_batch(train, torch.arange(job.train.batch_size))
    tpm.train()
    loss = eng.forward_backward(batch, weight=1.0, last=True)
    eng.sync()
    sq = eng.grad_sq_norm()
    grads = tpm.gather_full({n: p.grad for n, p in tpm.module.named_parameters()})
    groups.tp.close()
    return {"loss": loss, "sq": sq, "grads": grads}


CASES: list[tuple[str, dict[str, Any]]] = [
    ("regression", {"memory_optimization": "None"}),
    ("regression", {"micro_batches": 2, "communication_pattern": "ReduceScatter",
                    "gradient_accumulation": False}),
    ("lm", {"memory_optimization": "None"}),
    ("lm", {"micro_batches": 2, "communication_pattern": "ReduceScatter"}),
]


def parity_worker(ctx: WorkerContext, out: str) -> list[dict[str, Any]]:
    return [{"right": _tp_side(kind, out, conf, wrong=False),
             "wrong": _tp_side(kind, out, conf, wrong=True)} for kind, conf in CASES]


def _local(kind: str, out: str) -> dict[str, Any]:
    from paratrain.training import seed_everything
    from paratrain.training.loop import LocalEngine

    job = load_job(_doc(kind, out, "parity"))
    seed_everything(job.run.seed)
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    model = task.build_model(job.model, train)
    eng = LocalEngine(model, task, test, device=torch.device("cpu"))
    batch = fetch_batch(train, torch.arange(job.train.batch_size))
    model.train()
    loss = eng.forward_backward(batch, weight=1.0, last=True)
    return {"loss": loss, "sq": eng.grad_sq_norm(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def _close(tp: dict[str, Any], ref: dict[str, Any]) -> bool:
    ok = abs(tp["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    ok = ok and abs(tp["sq"] - ref["sq"]) <= 1e-5 * ref["sq"]
    ok = ok and set(tp["grads"]) == set(ref["grads"])
    # rtol 1e-5 per entry, with an absolute floor of 1e-6 of the model's largest gradient
    # entry: an attention key bias has a gradient that is 0 in exact arithmetic (softmax
    # does not see a shift of every key), so both sides hold rounding noise (4e-12 next
    # to 0.11), and the sequence-parallel layout sums a token's terms in another order
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    return ok and all(torch.allclose(tp["grads"][n], g, rtol=1e-5, atol=1e-6 * scale)
                      for n, g in ref["grads"].items())


@pytest.mark.slow
def test_loss_and_gradients_match_local(tmp_path: Path) -> None:
    """Regression and the tiny GPT; plain layout, and micro-batches with the sequence-parallel
    layout (once with the reductions after every micro-batch)."""
    refs = {kind: _local(kind, str(tmp_path)) for kind in ("regression", "lm")}
    ranks = run_distributed(parity_worker, 2, str(tmp_path), timeout_s=240)
    for i, (kind, conf) in enumerate(CASES):
        ref = refs[kind]
        assert ref["sq"] > 0 and len(ref["grads"]) > 4
        for r in ranks:  # every rank has the whole gradient and the same norm
            got = r[i]
            assert _close(got["right"], ref), (kind, conf, got["right"]["loss"], ref["loss"])
            # non-vacuity: a wrong reduction (sum instead of mean) fails the same comparison
            assert not _close(got["wrong"], ref), (kind, conf)
        assert ranks[0][i]["right"]["sq"] == ranks[1][i]["right"]["sq"]


def _resume_doc(tmp_path: Path, name: str) -> dict[str, Any]:
    doc = _doc("lm", str(tmp_path), name)
    doc["run"].update(checkpoint_every=3, max_restarts=1)
    doc["train"] = {"epochs": 1, "max_steps": 6, "batch_size": 8, "grad_accumulation": 2,
                    "grad_clip_norm": 0.5, "precision": "bf16", "lr_schedule": "cosine",
                    "warmup_steps": 2, "eval_every": 3,
                    "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01}}
    doc["tensor_parallel"] = {"tensor_parallel_size": 2, "micro_batches": 2}
    return doc


@pytest.mark.slow
def test_killed_and_restarted_run_is_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.dispatch import execute

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(HERE.parents[1])]))  # the workers import this data factory
    full = execute(load_job(_resume_doc(tmp_path, "full")))
    monkeypatch.setenv("PARATRAIN_FAULT_KILL", "1:3")  # rank 1 dies after step 3
    cut = execute(load_job(_resume_doc(tmp_path, "cut")))
    assert cut["restart_count"] == 1 and full["restart_count"] == 0
    assert full["steps"] == cut["steps"] == 6
    assert cut["parameters_sha256"] == full["parameters_sha256"]
    assert full["test_loss"] == cut["test_loss"]
    assert "test_perplexity" in full and "bigram_test_loss" in full
    # the run learns through the schedule (warmup, cosine) with clipping and bf16
    assert full["test_loss"] < 4.2  # ln(vocab ~65) is 4.17 at chance


def test_replication_factors_of_the_norm() -> None:
    """What each parameter adds to the TP-group sum: a column/row shard once, a 2-D grid
    weight once (g x g blocks), a grid bias 1/g (g blocks, held by g ranks each), a
    replicated parameter 1/tp (counted locally instead)."""
    from paratrain.tensor_parallel.grid import replicas_of

    shard, weight, bias, rep = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    shard.tp_shard_dim, shard.tp_sizes = 0, [1, 1]  # type: ignore[attr-defined]
    weight.tp_grid = [(None, 1, [3, 3]), (None, 0, [2, 2])]  # type: ignore[attr-defined]
    bias.tp_grid = [(None, 0, [2, 2])]  # type: ignore[attr-defined]
    assert [replicas_of(p, 4) for p in (shard, weight, bias, rep)] == [1, 1, 2, 4]
    assert [replicas_of(p, 2) for p in (shard, rep)] == [1, 2]


def test_a_checkpoint_from_before_the_one_loop_is_a_clear_error(tmp_path: Path) -> None:
    """The per-process ``torch.save`` layout of earlier versions is not resumed (checkpoints
    are torch.distributed.checkpoint folders now): the error names the file."""
    import json

    from paratrain.training.stores import RankStore

    run_dir = tmp_path / "old"
    (run_dir / "checkpoints" / "tp-rank0").mkdir(parents=True)
    (run_dir / "checkpoints" / "tp-rank0" / "ckpt-000000004.pt").write_bytes(b"")
    (run_dir / "checkpoints" / "tp-complete.json").write_text(json.dumps({"step": 4, "tp": 1, "dp": 1}))
    store = RankStore(run_dir, "tp", rank=0, world=1, group=None, layout={"tp": 1, "dp": 1},
                   layout_field="tensor_parallel.tensor_parallel_size")
    with pytest.raises(ConfigError, match="tp-complete.json .*per-process torch.save format"):
        store.load()


@pytest.mark.slow
def test_a_user_task_trains_under_tp_x_dp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/user_task.py (its own Dataset, model, L1 loss, metrics) under TP 2 x DP 2 (4
    processes): the summary has the task's metrics and beats the untrained model."""
    from paratrain.dispatch import execute
    from paratrain.task import evaluate
    from user_task import make_task

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(HERE.parents[1])]))
    summary = execute(load_job({
        "run": {"name": "user", "seed": 2, "output_dir": str(tmp_path)},
        "task": {"factory": "user_task:make_task", "hidden": 16},
        "train": {"epochs": 6, "batch_size": 16, "optimizer": {"name": "adam", "lr": 0.03}},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
        "tensor_parallel": {"tensor_parallel_size": 2},
    }))
    task = make_task(16)
    train, test = task.datasets(2)
    torch.manual_seed(2)
    untrained = evaluate(task.build_model(None, train), task, test)["mae"]
    assert summary["world_size"] == 4 and summary["task"]
    assert {"test_loss", "test_mae", "test_rmse", "best_test_mae"} <= set(summary), summary
    assert summary["test_mae"] < 0.6 * untrained, (summary["test_mae"], untrained)
    # the gathered dense model is the user's model: it loads and scores the same
    net = task.build_model(None, train)
    net.load_state_dict(read_model(summary["dense_model"]))
    assert evaluate(net, task, test)["mae"] == pytest.approx(summary["test_mae"], rel=1e-5)
