"""PopulationBased executor: real worker processes, real digits, real checkpoint files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.config import ConfigError
from paratrain.config.job import JobConfig, load_job
from paratrain.executors.population_based import runner as population
from paratrain.executors.population_based.member import member_path, state_digest
from paratrain.files import step_folders
from paratrain.models import build_model
from paratrain.training import build_optimizer, checkpoint
from paratrain.training.faults import FAULTS_ENV


def make_job(tmp_path: Path, name: str, **over: Any) -> JobConfig:
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp_path), "num_workers": 1},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0}},
        "strategy": {
            "type": "PopulationBased", "population_size": 4, "generations": 3,
            "exploit": {"method": "Truncation", "fraction": 0.5},
            "explore": {"method": "Perturbation", "factor": 0.3},
        },
        "population": {"steps_per_generation": 12},
        "search_space": {
            "lr": {"type": "log_uniform", "low": 0.003, "high": 0.5},
            "momentum": {"type": "uniform", "low": 0.0, "high": 0.95},
            "weight_decay": {"type": "log_uniform", "low": 1e-6, "high": 1e-2},
        },
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            doc.setdefault(section, {})[field] = value
        else:
            doc[section] = value
    return load_job(doc)


def lineage(summary: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((Path(summary["run_dir"]) / "lineage.json").read_text())
    return doc


def file_digest(job: JobConfig, path: Path) -> str:
    """Digest of a member checkpoint as a restored model + optimizer would see it."""
    torch.manual_seed(0)
    model = build_model(job.model, input_shape=(64,), num_classes=10)
    opt = build_optimizer(model.parameters(), job.train.optimizer)
    state = checkpoint.load_checkpoint(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state_digest(model, opt)


@pytest.mark.slow
def test_two_workers_exploit_byte_identical_and_failure_tolerated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 worker processes via the elastic launcher; member 2 fails every generation and
    one worker process crashes once (elastic restart + resume).

    After every exploit the recipient starts the next generation with the donor's exact
    weights and optimizer state (digest of the in-memory state on the worker that
    restored it == digest of the donor's state when it was saved), and trains with the
    explored hyperparameters, not the donor's. Parity: one process gives the same run.
    """
    crash = {"factory": "_workers_pbt:crashing_mlp", "name": None, "hidden": [32],
             "crash_when": str(tmp_path / "pbt2" / "checkpoints" / "step-000000001"),
             "crash_marker": str(tmp_path / "crashed")}
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"fail_members": [2]}))  # inherited by workers
    job = make_job(tmp_path, "pbt2", run__num_workers=2, run__max_restarts=1, model=crash)
    summary = population.run(job)
    # A worker died hard during generation 1; the elastic agent restarted the group,
    # which resumed from the population checkpoint after generation 0 (step-000000001).
    assert (tmp_path / "crashed").exists() and summary["restarts"] == 1
    doc = lineage(summary)
    gens = doc["generations"]
    assert summary["num_workers"] == 2 and len(gens) == 3
    ranks = {r["rank"] for r in map(json.loads, (tmp_path / "pbt2" / "metrics.jsonl").read_text().splitlines())}
    assert ranks == {0, 1}
    copies_checked = moved = 0
    for g, rec in enumerate(gens[:-1]):
        nxt = gens[g + 1]
        assert rec["errors"][2] and rec["fitness"][2] is None  # the failing member
        assert {c["recipient"] for c in rec["copies"]} >= {2}  # worst is always replaced
        copied = {c["recipient"]: c for c in rec["copies"]}
        for i in range(4):
            start = nxt["digests"][i]["start"]
            if i in copied:
                c = copied[i]
                donor_end = rec["digests"][c["donor"]]["end"]
                assert start == donor_end
                # ... and the donor's file on disk holds exactly that state.
                assert file_digest(job, member_path(summary["run_dir"], g, c["donor"])) == donor_end
                applied = nxt["applied"][i]
                for k in ("lr", "momentum", "weight_decay"):
                    assert applied[k] == pytest.approx(c["hparams"][k], rel=1e-12)
                    assert applied[k] == pytest.approx(nxt["hparams"][i][k], rel=1e-12)
                assert applied["lr"] != pytest.approx(c["donor_hparams"]["lr"], rel=1e-9)
                own_end = rec["digests"][i]["end"]
                moved += own_end != donor_end
                copies_checked += 1
            elif rec["digests"][i]["end"] is not None:
                assert start == rec["digests"][i]["end"]  # kept its own state
    assert copies_checked >= 4 and moved >= 1  # non-vacuous: copies changed weights
    assert summary["failures"] == 3 and summary["best_member"] != 2
    assert (Path(summary["run_dir"]) / "report.png").stat().st_size > 10_000

    # Parity: the same job in one process, uninterrupted, gives the same lineage, digest
    # for digest (so neither the worker count nor the crash changed anything).
    single = population.run(make_job(tmp_path, "pbt1", model=crash))
    for a, b in zip(gens, lineage(single)["generations"], strict=True):
        assert a["hparams"] == b["hparams"] and a["fitness"] == b["fitness"]
        assert a["digests"] == b["digests"] and a["copies"] == b["copies"]


@pytest.mark.slow
def test_resume_continues_to_same_result(tmp_path: Path) -> None:
    job = make_job(tmp_path, "full", population={"steps_per_generation": 12, "keep_generations": 2},
                   strategy={
        "type": "PopulationBased", "population_size": 4, "generations": 3,
        "exploit": {"method": "Binary", "threshold": 0.0}, "explore": {"method": "Resample"},
    })
    full = population.run(job)
    run_dir = Path(full["run_dir"])
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("gen-*")) == ["gen-000001", "gen-000002"]
    # Simulate a crash during the last generation: its population checkpoint, lineage
    # entry and summary never got written; one member file did.
    assert [p.name for p in step_folders(run_dir / "checkpoints")] == ["step-000000002", "step-000000003"]
    shutil.rmtree(run_dir / "checkpoints" / "step-000000003")
    for p in sorted((run_dir / "checkpoints" / "gen-000002").iterdir())[1:]:
        p.unlink()
    (run_dir / "summary.json").unlink()
    before = lineage(full)
    resumed = population.run(job, resume=True)
    after = lineage(resumed)
    assert after["generations"] == before["generations"]
    for key in ("best_member", "best_fitness", "best_schedule", "parameters_sha256", "final_fitness"):
        assert resumed[key] == full[key]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["generation"], r["member"]) for r in records] == [(g, m) for g in range(3) for m in range(4)]
    # Non-vacuity: a fresh run with another seed does not reproduce the lineage.
    other = population.run(make_job(tmp_path, "other", run={
        "name": "other", "seed": 4, "output_dir": str(tmp_path), "num_workers": 1}))
    assert lineage(other)["generations"][-1]["fitness"] != after["generations"][-1]["fitness"]


@pytest.mark.slow
def test_keep_one_generation_falls_back_to_the_older_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """keep_generations = 1 prunes the member files the older checkpoint's generation
    started from; they live in the population checkpoint too, so a damaged newest
    checkpoint falls back to the older one and the run ends as the uninterrupted one did
    (2 workers: members restored on both ranks, then copied across them)."""
    job = make_job(tmp_path, "keep1", run__num_workers=2, population={"steps_per_generation": 6,
                                                                       "keep_generations": 1})
    full = population.run(job)
    run_dir = Path(full["run_dir"])
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("gen-*")) == ["gen-000002"]
    newest = ckpts / "step-000000003" / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    (run_dir / "summary.json").unlink()
    before = lineage(full)
    capfd.readouterr()
    resumed = population.run(job, resume=True)
    err = capfd.readouterr().err
    assert "falling back to step 2" in err, err[-3000:]
    assert lineage(resumed)["generations"] == before["generations"]
    for key in ("best_member", "best_fitness", "best_schedule", "parameters_sha256", "final_fitness"):
        assert resumed[key] == full[key]
    assert before["generations"][1]["copies"]  # non-vacuous: generation 2 starts from copies
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["generation"], r["member"]) for r in records] == [(g, m) for g in range(3) for m in range(4)]


def test_every_member_failing_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"fail_members": [0, 1, 2, 3]}))
    job = make_job(tmp_path, "allfail",
                   strategy={"type": "PopulationBased", "population_size": 4, "generations": 2,
                             "exploit": {"method": "Truncation", "fraction": 0.25},
                             "explore": {"method": "Resample"}})
    with pytest.raises(RuntimeError, match="generation 0: every member failed.*injected failure"):
        population.run(job)


@pytest.mark.slow
def test_digits_pbt_at_least_as_good_as_random_search(tmp_path: Path) -> None:
    """Population of 4 over lr, momentum, weight decay vs the same 4 members trained
    independently for the same total budget (random search; same seed, same draws)."""
    common = dict(
        strategy={"type": "PopulationBased", "population_size": 4, "generations": 5,
                  "exploit": {"method": "Truncation", "fraction": 0.25},
                  "explore": {"method": "Perturbation", "factor": 0.2}},
        search_space={
            "lr": {"type": "log_uniform", "low": 1e-3, "high": 0.3},
            "momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
            "weight_decay": {"type": "log_uniform", "low": 1e-6, "high": 1e-2},
        },
    )
    pbt = population.run(make_job(tmp_path, "pbt", population={"steps_per_generation": 25}, **common))
    rs = population.run(make_job(tmp_path, "rs", population={"steps_per_generation": 25, "evolve": False},
                                 **common))
    assert rs["copies"] == 0 and pbt["copies"] >= 4
    first_pbt, first_rs = lineage(pbt)["generations"][0], lineage(rs)["generations"][0]
    assert first_pbt["hparams"] == first_rs["hparams"]  # same seed, same population
    assert first_pbt["fitness"] == first_rs["fitness"]
    assert pbt["best_fitness"] >= rs["best_fitness"]
    assert pbt["best_fitness"] > 0.85
    assert len(pbt["best_schedule"]) == 5


def test_validation_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        population.run(make_job(tmp_path, "v1", search_space={"lrate": {"type": "uniform", "low": 0.1, "high": 1}}))
    assert e.value.problems[0][0] == "search_space.lrate" and "momentum" in e.value.problems[0][1]
    with pytest.raises(ConfigError, match="empty"):
        population.run(make_job(tmp_path, "v2", search_space={}))
    with pytest.raises(ConfigError, match="search_space.lr.*must be <"):
        make_job(tmp_path, "v3", search_space={"lr": {"type": "uniform", "low": 1.0, "high": 0.1}})
    with pytest.raises(ConfigError, match="population.metric"):
        population.run(make_job(tmp_path, "v4", population={"metric": "f1"}))
    with pytest.raises(ConfigError, match="integers"):
        population.run(make_job(tmp_path, "v5", search_space={"batch_size": {"type": "uniform", "low": 8, "high": 64}}))
    with pytest.raises(ConfigError, match="search_space.momentum: momentum=-0.5 is invalid"):
        population.run(make_job(tmp_path, "v7", search_space={"momentum": {"type": "uniform", "low": -0.5, "high": 0.5}}))
    # Model-factory keywords are hyperparameters too (mlp takes dropout, activation).
    from paratrain.executors.population_based.member import validate_job

    roles = validate_job(make_job(tmp_path, "v6", search_space={
        "dropout": {"type": "uniform", "low": 0.0, "high": 0.5},
        "activation": {"type": "choice", "values": ["relu", "tanh"]},
        "batch_size": {"type": "int", "low": 16, "high": 64},
    }))
    assert roles["dropout"] == "dropout" and roles["batch_size"] == "batch" and roles["lr"] == "optimizer"


def test_model_kwargs_and_batch_size_as_hyperparameters(tmp_path: Path) -> None:
    """activation (model kwarg: inherited, never explored) and batch_size (int) evolve."""
    job = make_job(tmp_path, "kw", search_space={
        "activation": {"type": "choice", "values": ["relu", "tanh", "gelu"]},
        "batch_size": {"type": "int", "low": 8, "high": 64},
        "lr": {"type": "log_uniform", "low": 0.01, "high": 0.3},
    }, population={"steps_per_generation": 5})
    summary = population.run(job)
    gens = lineage(summary)["generations"]
    for rec in gens:
        for h in rec["hparams"]:
            assert type(h["batch_size"]) is int and 8 <= h["batch_size"] <= 64
        for c in rec["copies"]:
            assert c["hparams"]["activation"] == c["donor_hparams"]["activation"]
        for h, m in zip(rec["hparams"], rec["metrics"], strict=True):
            assert m["batch_size"] == h["batch_size"]
    shutil.rmtree(summary["run_dir"])


def test_min_mode_and_resume_mismatch(tmp_path: Path) -> None:
    tiny = {"type": "PopulationBased", "population_size": 3, "generations": 2,
            "exploit": {"method": "Truncation", "fraction": 0.3},
            "explore": {"method": "Perturbation", "factor": 0.2}}
    job = make_job(tmp_path, "mn", strategy=tiny,
                   population={"steps_per_generation": 3, "metric": "loss", "mode": "min"})
    s = population.run(job)
    losses = s["final_fitness"]
    assert s["best_fitness"] == min(losses) and s["test_loss"] == min(losses)
    rec = lineage(s)["generations"][0]
    worst = max(range(3), key=lambda i: rec["fitness"][i])
    assert [c["recipient"] for c in rec["copies"]] == [worst]  # highest loss replaced
    bigger = make_job(tmp_path, "mn", strategy={**tiny, "population_size": 4},
                      population={"steps_per_generation": 3, "metric": "loss", "mode": "min"})
    with pytest.raises(ConfigError, match="population of 3, not 4"):
        population.run(bigger, resume=True)
    with pytest.warns(UserWarning, match="mode='min'"):
        population.run(make_job(tmp_path, "mx", strategy={**tiny, "generations": 1},
                                population={"steps_per_generation": 1, "metric": "loss"}))


def test_member_restore_applies_own_hyperparameters_after_loading(tmp_path: Path) -> None:
    """The bug class this guards against: ``optimizer.load_state_dict`` restores the
    donor's param-group values, silently undoing the explored hyperparameters."""
    from paratrain.executors.population_based.member import MemberRunner, validate_job

    job = make_job(tmp_path, "restore", population={"steps_per_generation": 4})
    run_dir = tmp_path / "restore"
    runner = MemberRunner(job, run_dir, validate_job(job), torch.device("cpu"))
    donor_h = {"lr": 0.5, "momentum": 0.9, "weight_decay": 1e-3}
    mine_h = {"lr": 0.01, "momentum": 0.1, "weight_decay": 1e-5}
    donor = runner.run(0, 0, donor_h, None)
    runner.writer.flush()
    copy = runner.run(1, 1, mine_h, 0)
    runner.writer.flush()
    assert copy["error"] is None and copy["start_digest"] == donor["end_digest"]
    assert {k: copy["applied"][k] for k in mine_h} == mine_h
    # Non-vacuity: plain load_state_dict really does bring the donor's values back.
    state = checkpoint.load_checkpoint(member_path(run_dir, 0, 0))
    model = build_model(job.model, input_shape=(64,), num_classes=10)
    opt = build_optimizer(model.parameters(), job.train.optimizer, **mine_h)
    opt.load_state_dict(state["optimizer"])
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["momentum"] == 0.9
    # A copy whose donor file is missing fails as a member (worst fitness), not the run.
    lost = runner.run(2, 1, mine_h, 3)
    assert lost["fitness"] is None and "No such file" in lost["error"]
