"""DataParallel trains any Task through the one loop (issue 14):

* parity: on the same batch, DataParallel's loss and (all-reduced) gradients equal Local's
  for the regression task (MSE) and the GPT language model, with 2 and 4 gloo ranks
  (rtol 1e-5, fp32; the 2-rank groups are two pairs of one 4-rank launch); a task whose loss is summed instead of averaged must fail the same
  comparison (non-vacuity);
* accumulation: DataParallel x2 with ``grad_accumulation = 2`` and batch 4 takes Local's
  steps of batch 16 (the same rows per step), parameters equal to rtol 1e-5;
* resume: with a cosine schedule, warm-up, clipping, accumulation and bf16 on, a run
  SIGKILLed midway and resumed ends with the uninterrupted run's parameter digest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_dp_task import dp_cases_world_and_pairs, grads_of, task_model_batch
from paratrain.comm.launch import WorkerError
from paratrain.comm.testing import run_distributed
from paratrain.config import load_job
from paratrain.executors import local
from paratrain.executors.data_parallel import runner as dp
from paratrain.training.loop import LocalEngine

pytestmark = [pytest.mark.timeout(600)]

REGRESSION: dict[str, Any] = {
    "run": {"seed": 5}, "task": {"name": "regression"}, "data": {"name": "diabetes"},
    "model": {"name": "mlp", "hidden": [16]},
}
GPT: dict[str, Any] = {
    "run": {"seed": 5}, "task": {"name": "language_model", "block_size": 16},
    "data": {"name": "shakespeare"},
    "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0},
}


def _local(doc: dict[str, Any], rows: int, wrong: bool) -> tuple[float, list[list[float]]]:
    task, model, batch, test = task_model_batch(doc, rows, wrong=wrong)
    eng = LocalEngine(model, task, test, device=torch.device("cpu"))
    loss = eng.forward_backward(batch, weight=1.0, last=True)
    return loss, grads_of(model)


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-7)
               for x, y in zip(a, b, strict=True))


def _cases(world: int) -> list[tuple[dict[str, Any], int, bool]]:
    return [(doc, 8 * world, wrong) for doc in (REGRESSION, GPT) for wrong in (False, True)]


@pytest.mark.parametrize("world", [2, 4])
def test_dp_loss_and_gradients_equal_local_on_the_same_batch(
        world: int, dp_results: dict[Any, Any]) -> None:
    cases = _cases(world)
    results = dp_results[world]
    for i, (doc, rows, wrong) in enumerate(cases):
        loss, grads = _local(doc, rows, wrong)
        for per_rank in results:
            r = per_rank[i]
            assert r["grads"] != [[0.0] * len(g) for g in r["grads"]]
            if not wrong:
                assert r["loss"] == pytest.approx(loss, rel=1e-5)
                assert _close(r["grads"], grads)
            else:  # a summed loss: the mean of the ranks' sums is 1/world of the sum
                assert not _close(r["grads"], grads)


def _job(tmp: Path, name: str, strategy: dict[str, Any], **train: Any) -> Any:
    doc = {**REGRESSION, "run": {"seed": 5, "name": name, "output_dir": str(tmp), "checkpoint_every": 3},
           "strategy": strategy,
           "train": {"epochs": 1, "batch_size": 4, "max_steps": 8, "eval_every": 4,
                     "optimizer": {"name": "sgd", "lr": 0.05}, **train}}
    return load_job(doc)


DP2 = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """Every case with 4 gloo ranks, and with 2 (two 2-rank groups of the same 4-rank
    launch, each its own DataParallel group); then ranks 0-1 train the 2-replica job of
    :func:`test_dp_accumulation_takes_locals_big_batch_steps` (``runner.run`` itself, the
    launch around the same ``train_replica``, is the resume test's): one launch in all."""
    tmp = tmp_path_factory.mktemp("acc")
    job = _job(tmp, "dp", DP2, grad_accumulation=2, max_steps=5).to_json_dict()
    out = run_distributed(dp_cases_world_and_pairs, 4, _cases(4), _cases(2), job, timeout_s=300)
    return {4: [r["world"] for r in out], 2: [r["pairs"] for r in out], "accumulation": out[0]["job"]}


def test_dp_accumulation_takes_locals_big_batch_steps(tmp_path: Path, dp_results: dict[Any, Any]) -> None:
    a = dp_results["accumulation"]
    b = local.run(_job(tmp_path, "local", {"type": "Local"}, batch_size=16, max_steps=5))
    assert a["steps"] == b["steps"] == 5
    assert a["test_mse"] == pytest.approx(b["test_mse"], rel=1e-5)
    assert a["test_r2"] == pytest.approx(b["test_r2"], rel=1e-4, abs=1e-6)
    assert a["test_loss"] == a["test_mse"]
    # non-vacuity: steps of half the rows (DataParallel x2 without accumulation) differ
    c = local.run(_job(tmp_path, "local8", {"type": "Local"}, batch_size=8, max_steps=5))
    assert c["test_mse"] != pytest.approx(b["test_mse"], rel=1e-5)


def test_dp_resume_with_every_train_option_is_bit_identical(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dp2 = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    opts = {"lr_schedule": "cosine", "warmup_steps": 2, "grad_clip_norm": 0.5,
            "grad_accumulation": 2, "precision": "bf16",
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}}
    clean = dp.run(_job(tmp_path, "clean", dp2, **opts))
    monkeypatch.setenv(dp.FAULT_ENV, "1:5")  # rank 1 dies after step 5 (checkpoint at 3)
    with pytest.raises(WorkerError, match="Signal 9|SIGKILL"):
        dp.run(_job(tmp_path, "cut", dp2, **opts))
    monkeypatch.delenv(dp.FAULT_ENV)
    resumed = dp.run(_job(tmp_path, "cut", dp2, **opts), resume=True)
    assert resumed["steps"] == clean["steps"] == 8
    assert resumed["parameters_sha256"] == clean["parameters_sha256"]
