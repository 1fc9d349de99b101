"""PopulationBased trains any Task through the one loop's Trainer: regression (diabetes,
mse min), a tiny char language model (loss min, gpt with dropout), a member's step equals
a plain step on the same batch, and a stopped + resumed run with clip, accumulation, bf16
and a cosine schedule ends bit-identical."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.config.job import JobConfig, load_job
from paratrain.data.shakespeare import CharBlocks, load_corpus
from paratrain.executors.population_based import runner as population
from paratrain.executors.population_based.member import MemberRunner, seed_of, validate_job
from paratrain.files import step_folders
from paratrain.task import fetch_batch, resolve_task
from paratrain.training import build_optimizer
from paratrain.training.stores import read_rank_state

HERE = Path(__file__).resolve().parent


def tiny_lm_data(*, seed: int, block_size: int) -> tuple[CharBlocks, CharBlocks]:
    """A slice of the shakespeare corpus (a language_model data.factory): fast tests."""
    del seed
    c = load_corpus()
    return (CharBlocks(c.train[:8_000], block_size=block_size, vocab=c.vocab),
            CharBlocks(c.test[:1_500], block_size=block_size, vocab=c.vocab))


PBT = {"type": "PopulationBased", "population_size": 4, "generations": 3,
       "exploit": {"method": "Truncation", "fraction": 0.25},
       "explore": {"method": "Perturbation", "factor": 0.3}}


def regression_job(tmp_path: Path, name: str, **over: Any) -> JobConfig:
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 5, "output_dir": str(tmp_path), "num_workers": 1},
        "task": {"name": "regression"}, "data": {"name": "diabetes"},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05}},
        "strategy": PBT, "population": {"steps_per_generation": 6},
        "search_space": {"lr": {"type": "log_uniform", "low": 1e-3, "high": 0.3}},
    }
    doc.update(over)
    return load_job(doc)


def lm_job(tmp_path: Path, name: str, **over: Any) -> JobConfig:
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 2, "output_dir": str(tmp_path), "num_workers": 1},
        "task": {"name": "language_model", "block_size": 16},
        "data": {"factory": "test_pbt_task:tiny_lm_data"},
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32},
        "train": {"batch_size": 16, "optimizer": {"name": "adamw", "lr": 3e-3}},
        "strategy": PBT, "population": {"steps_per_generation": 4},
        "search_space": {"lr": {"type": "log_uniform", "low": 1e-3, "high": 3e-2},
                         "dropout": {"type": "uniform", "low": 0.0, "high": 0.3}},
    }
    doc.update(over)
    return load_job(doc)


def lineage(summary: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((Path(summary["run_dir"]) / "lineage.json").read_text())
    return doc


def records(summary: dict[str, Any]) -> list[dict[str, Any]]:
    text = (Path(summary["run_dir"]) / "metrics.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


def check_min_mode_exploit(doc: dict[str, Any]) -> int:
    """Under min mode, Truncation(0.25) of 4 replaces the member with the HIGHEST value by
    the one with the LOWEST; returns the number of copies checked."""
    checked = 0
    for rec in doc["generations"][:-1]:
        fit = rec["fitness"]
        worst = max(range(4), key=lambda i: (fit[i], i))
        best = min(range(4), key=lambda i: (fit[i], -i))
        assert [(c["recipient"], c["donor"]) for c in rec["copies"]] == [(worst, best)]
        checked += 1
    return checked


def test_regression_pbt_mse_min(tmp_path: Path) -> None:
    s = population.run(regression_job(tmp_path, "reg"))
    assert s["task"] == "regression" and s["metric"] == "mse" and s["mode"] == "min"
    final = s["final_fitness"]
    assert s["best_fitness"] == min(final) and s["test_mse"] == s["best_fitness"]
    assert s["test_loss"] == s["test_mse"] and "test_r2" in s and "test_accuracy" not in s
    assert check_min_mode_exploit(lineage(s)) == 2
    recs = records(s)
    assert len(recs) == 12 and all({"test_mse", "test_r2", "test_loss"} <= set(r) for r in recs)
    assert all(r["fitness"] == r["test_mse"] for r in recs)
    # diabetes targets are standardised: a trained member beats predicting zero (mse ~1)
    assert s["best_fitness"] < 0.9
    # a metric the task does not have: one ConfigError naming the field, listing the metrics
    with pytest.raises(ConfigError) as e:
        population.run(regression_job(tmp_path, "bad", population={"metric": "accuracy"}))
    field, msg = e.value.problems[0]
    assert field == "population.metric" and "mse" in msg and "r2" in msg and "train_loss" in msg


def test_tiny_lm_pbt_loss_min_with_dropout(tmp_path: Path) -> None:
    s = population.run(lm_job(tmp_path, "lm"))
    assert s["task"] == "language_model" and s["metric"] == "loss" and s["mode"] == "min"
    assert s["best_fitness"] == min(s["final_fitness"]) == s["test_loss"]
    assert s["test_perplexity"] == pytest.approx(math.exp(s["test_loss"]))
    assert s["test_bits_per_token"] == pytest.approx(s["test_loss"] / math.log(2))
    assert 1.0 < s["bigram_test_loss"] < 4.5
    assert s["best_fitness"] < math.log(len(load_corpus().vocab))  # learnt something
    doc = lineage(s)
    assert check_min_mode_exploit(doc) == 2
    for rec in doc["generations"]:
        for c in rec["copies"]:  # dropout and lr are both explored (Perturbation)
            assert c["hparams"]["dropout"] != c["donor_hparams"]["dropout"]
            assert c["hparams"]["lr"] != c["donor_hparams"]["lr"]
    assert all("test_perplexity" in r for r in records(s))

    # dropout is applied when the member's model is built
    job = lm_job(tmp_path, "drop", population={"steps_per_generation": 1})
    runner = MemberRunner(job, tmp_path / "drop", validate_job(job), torch.device("cpu"))
    out = runner.run(0, 0, {"lr": 1e-2, "dropout": 0.25}, None)
    assert out["error"] is None
    ps = {m.p for m in runner._live[0].model.modules() if isinstance(m, nn.Dropout)}
    assert ps == {0.25}
    # the next generation continues the same weights with an explored dropout
    live = runner._live[0].model
    out = runner.run(0, 1, {"lr": 1e-2, "dropout": 0.1}, 0)
    assert out["error"] is None and runner._live[0].model is live
    assert {m.p for m in live.modules() if isinstance(m, nn.Dropout)} == {0.1}


def _member_and_reference(job: JobConfig, tmp_path: Path, *, reduction: str) -> tuple[list, list]:
    """Parameters after one member step vs after one plain torch step (forward, the
    task's loss written out by hand with ``reduction``, backward, step) on the same
    batches from the same initial model and optimizer."""
    runner = MemberRunner(job, tmp_path / job.run.name, validate_job(job), torch.device("cpu"))
    hp = {"lr": 0.02}
    out = runner.run(0, 0, hp, None)
    assert out["error"] is None and out["metrics"]["steps"] == 1
    member = [p.detach().clone() for p in runner._live[0].model.parameters()]

    task = resolve_task(job)
    train, _ = task.datasets(job.run.seed)
    torch.manual_seed(seed_of(job.run.seed, 0, -1))
    model = task.build_model(job.model, train)
    opt = build_optimizer(model.parameters(), job.train.optimizer, **hp)
    g = torch.Generator().manual_seed(seed_of(job.run.seed, 0, 0))
    perm = torch.randperm(len(train), generator=g)  # type: ignore[arg-type]
    bs, k = job.train.batch_size, job.train.grad_accumulation
    batch = fetch_batch(train, perm[: bs * k])  # k batches of bs == one batch of k * bs
    torch.manual_seed(seed_of(job.run.seed, 0, 0, 1))
    model.train()
    opt.zero_grad()
    out_t = model(batch[0])
    if job.task.name == "regression":
        loss = nn.functional.mse_loss(out_t.reshape(batch[1].shape), batch[1], reduction=reduction)
    else:
        loss = nn.functional.cross_entropy(out_t.reshape(-1, out_t.shape[-1]), batch[1].reshape(-1),
                                           reduction=reduction)
    loss.backward()
    opt.step()
    return member, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["regression", "lm"])
def test_member_step_equals_plain_step(tmp_path: Path, kind: str) -> None:
    train = {"batch_size": 8, "grad_accumulation": 2, "optimizer": {"name": "sgd", "lr": 0.02}}
    over = {"population": {"steps_per_generation": 1}, "train": train,
            "search_space": {"lr": {"type": "log_uniform", "low": 1e-3, "high": 0.1}}}
    job = (regression_job(tmp_path, "p-reg", **over) if kind == "regression"
           else lm_job(tmp_path, "p-lm", **over))
    member, ref = _member_and_reference(job, tmp_path, reduction="mean")
    for a, b in zip(member, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # non-vacuity: a wrong reduction (sum instead of mean) fails the same comparison
    member2, wrong = _member_and_reference(job, tmp_path / "w", reduction="sum")
    assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-7)
               for a, b in zip(member2, wrong, strict=True))


def _resume_doc(tmp_path: Path, name: str) -> dict[str, Any]:
    job = lm_job(tmp_path, name, train={
        "batch_size": 8, "grad_accumulation": 2, "grad_clip_norm": 0.5, "precision": "bf16",
        "lr_schedule": "cosine", "warmup_steps": 2,
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01}},
        population={"steps_per_generation": 3},
        strategy={**PBT, "population_size": 2, "exploit": {"method": "Truncation", "fraction": 0.5}})
    return job.to_json_dict()


def test_stop_and_resume_bit_identical_clip_accum_bf16_cosine(tmp_path: Path) -> None:
    full = population.run(load_job(_resume_doc(tmp_path, "full")))
    doc = _resume_doc(tmp_path, "cut")
    code = ("import json, sys\n"
            "from paratrain.config.job import load_job\n"
            "from paratrain.executors.population_based import runner\n"
            "runner.run(load_job(json.loads(sys.argv[1])))\n")
    env = {**os.environ, "PARATRAIN_FAULT_KILL": "0:1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(doc)], env=env,
                          capture_output=True, text=True, timeout=300)
    run_dir = tmp_path / "cut"
    # it really stopped after the first generation's population checkpoint
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (run_dir / "summary.json").exists()
    assert [p.name for p in step_folders(run_dir / "checkpoints")] == ["step-000000001"]
    saved = read_rank_state(run_dir / "checkpoints" / "step-000000001", 0)["engine"]["population"]
    assert json.loads(saved["json"])["generation"] == 1
    resumed = population.run(load_job(doc), resume=True)
    assert resumed["parameters_sha256"] == full["parameters_sha256"]
    a, b = lineage(full)["generations"], lineage(resumed)["generations"]
    assert [r["digests"] for r in a] == [r["digests"] for r in b]
    assert [r["fitness"] for r in a] == [r["fitness"] for r in b]
    # the cosine schedule (with warmup) ran over the member's 3 x 3 steps: every applied
    # lr_now is base x f(step) and it changes between generations; a copied member's base
    # lr is its own explored lr, not the donor's
    from paratrain.training.stepping import lr_factor

    ratios = set()
    for g, rec in enumerate(a):
        for i, app in enumerate(rec["applied"]):
            assert app["lr"] == pytest.approx(rec["hparams"][i]["lr"], rel=1e-12)
            f = lr_factor(3 * g, kind="cosine", warmup_steps=2, total_steps=9)
            assert app["lr_now"] == pytest.approx(app["lr"] * f, rel=1e-12)
            ratios.add(round(app["lr_now"] / app["lr"], 9))
    assert len(ratios) == 3  # 0.5 (warmup), then two points of the cosine
    assert sum(len(r["copies"]) for r in a) == 2  # exploit happened (and the lr followed)
