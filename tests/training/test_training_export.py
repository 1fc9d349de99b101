"""The trained model out (paratrain.training.export): every strategy writes one state_dict
under the model's own names; it loads into a fresh ``task.build_model(...)`` with
``strict=True`` and scores the run's reported test loss; ``paratrain export`` writes it as
.safetensors or .pt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from paratrain import cli
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.task import evaluate, resolve_task
from paratrain.training.export import complete_state, read_model, tied_names

pytestmark = pytest.mark.timeout(300)

REG = {"task": {"name": "regression"}, "data": {"name": "diabetes"},
       "model": {"name": "mlp", "hidden": [16, 8]},
       "train": {"epochs": 2, "batch_size": 16, "optimizer": {"name": "adam", "lr": 0.01}}}
# a tied head (lm_head.weight is tok_emb.weight) cut across two pipeline stages; strided
# blocks: the run and the test evaluate 1,042 test blocks, not 33,328
GPT = {"task": {"name": "language_model", "block_size": 16, "stride": 512}, "data": {"name": "shakespeare"},
       "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16},
       "train": {"epochs": 1, "max_steps": 6, "batch_size": 8, "optimizer": {"name": "adam", "lr": 3e-3}}}

CASES: dict[str, dict[str, Any]] = {
    "Local": {**REG},
    "DataParallel": {**REG, "strategy": {"type": "DataParallel", "num_replicas": 2,
                                         "aggregation": {"method": "AllReduce"}}},
    "TensorParallel": {**REG, "tensor_parallel": {"tensor_parallel_size": 2}},
    "ModelParallel": {**GPT, "strategy": {
        "type": "ModelParallel",
        "communication": {"protocol": "Pipeline", "micro_batch_size": 3, "schedule": "1F1B"},
        "partitions": [{"node_ids": ["block0.mlp", "block1", "ln_f", "head"], "target": {"WorkerId": "worker-1"}}]}},
    "Federated": {**REG, "strategy": {"type": "Federated", "num_clients": 4, "rounds": 2,
                                      "aggregation": {"method": "FedAvg"},
                                      "client_selection": {"method": "Random", "fraction": 0.5}},
                  "federated": {"local_epochs": 1, "batch_size": 16}},
    "PopulationBased": {**REG, "strategy": {
        "type": "PopulationBased", "population_size": 2, "generations": 2,
        "exploit": {"method": "Truncation", "fraction": 0.5},
        "explore": {"method": "Perturbation", "factor": 0.3}},
        "population": {"steps_per_generation": 4},
        "search_space": {"lr": {"type": "log_uniform", "low": 1e-3, "high": 0.1}}},
}


@pytest.mark.parametrize("kind", list(CASES))
def test_exported_model_loads_strict_and_scores_the_reported_loss(tmp_path: Path, kind: str) -> None:
    doc = {**CASES[kind], "run": {"name": "x", "seed": 3, "output_dir": str(tmp_path)}}
    if kind in ("Federated", "PopulationBased"):
        doc["run"]["num_workers"] = 2
    summary = paratrain.fit(doc)
    run_dir = Path(summary["run_dir"])
    state = paratrain.load_model(run_dir)

    job = load_job(doc)
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    fresh = task.build_model(job.model, train)
    assert list(state) == list(fresh.state_dict())  # the model's own names, in its order
    fresh.load_state_dict(state, strict=True)
    if kind == "ModelParallel":  # the tied head and embedding: both names, one tensor
        assert len(tied_names(fresh)) == 1
    assert evaluate(fresh, task, test)["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    # non-vacuity: the untrained model scores otherwise
    untrained = task.build_model(job.model, train)
    assert evaluate(untrained, task, test)["loss"] != pytest.approx(summary["test_loss"], rel=1e-3)

    # the CLI writes it as .pt and .safetensors; both give the same tensors
    for name in ("m.pt", "m.safetensors"):
        out = tmp_path / name
        assert cli.main(["export", str(run_dir), "--out", str(out), "-q"]) == 0
        again = (torch.load(out, weights_only=True) if name.endswith(".pt")
                 else read_model(out))
        assert list(again) == list(state)
        assert all(torch.equal(again[k], state[k]) for k in state)


def test_export_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="is not a folder"):
        paratrain.load_model(tmp_path / "missing")
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(ConfigError, match="has not finished"):
        paratrain.load_model(tmp_path / "unfinished")
    assert cli.main(["export", str(tmp_path / "unfinished"), "--out", str(tmp_path / "a.pt")]) == 2
    assert "--resume" in capsys.readouterr().err


def test_complete_state_fills_ties_and_names_missing() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    names, ties = list(model.state_dict()), tied_names(model)
    assert ties == [["0.weight", "1.weight"]]
    got = complete_state([{"1.weight": model[1].weight}], names, ties)
    assert list(got) == names and torch.equal(got["0.weight"], got["1.weight"])
    with pytest.raises(RuntimeError, match="0.weight"):
        complete_state([{}], names, ties)


def test_summary_json_is_written_after_the_model(tmp_path: Path) -> None:
    """A finished run (summary.json present) always has its model file."""
    summary = paratrain.fit({**REG, "run": {"name": "y", "output_dir": str(tmp_path)}})
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "model.safetensors").stat().st_mtime_ns <= (run_dir / "summary.json").stat().st_mtime_ns
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == summary["steps"]


def test_federated_client_models_hold_their_personal_parts(tmp_path: Path) -> None:
    """FedPer (a personal head): ``--client c`` gives the global body with client c's own
    head; clients' heads differ, every body equals the global model's."""
    summary = paratrain.fit({
        "run": {"name": "fedper", "seed": 0, "output_dir": str(tmp_path), "num_workers": 2},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits", "partition": {"method": "shards", "shards_per_client": 2}},
        "train": {"optimizer": {"name": "sgd", "lr": 0.1}},
        "federated": {"local_epochs": 1, "batch_size": 20},
        "strategy": {"type": "Federated", "num_clients": 4, "rounds": 2,
                     "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}},
        "subgraphs": {"head": {"type": "Local"}},
    })
    run_dir = Path(summary["run_dir"])
    glob = paratrain.load_model(run_dir)
    clients = [paratrain.load_model(run_dir, client=c) for c in range(4)]
    for own in clients:
        assert list(own) == list(glob)
        assert all(torch.equal(own[k], glob[k]) for k in glob if not k.startswith("head."))
    heads = [own["head.weight"] for own in clients]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], glob["head.weight"])
    out = tmp_path / "c3.pt"
    assert cli.main(["export", str(run_dir), "--client", "3", "--out", str(out), "-q"]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["head.weight"], heads[3])
    with pytest.raises(ConfigError, match="no model of client 9"):
        paratrain.load_model(run_dir, client=9)


@pytest.mark.parametrize("kind", ["Local", "DataParallel", "TensorParallel", "Federated"])
def test_an_unfinished_run_exports_its_newest_checkpoint(tmp_path: Path, kind: str) -> None:
    """No model.safetensors yet (interrupted, or still running): the newest complete
    checkpoint, merged by the model's names from every process's file, with a warning
    (Federated: the global model of its newest round's checkpoint)."""
    doc = {**CASES[kind], "run": {"name": "u", "seed": 3, "output_dir": str(tmp_path)}}
    run_dir = Path(paratrain.fit(doc)["run_dir"])
    final = paratrain.load_model(run_dir)
    (run_dir / "model.safetensors").unlink()  # as before the run's end
    unit = "round" if kind == "Federated" else "step"
    with pytest.warns(RuntimeWarning, match=f"has not finished: its model at {unit}"):
        state = paratrain.load_model(run_dir)
    assert sorted(state) == sorted(final) and all(torch.equal(state[k], final[k]) for k in final)


def test_an_unfinished_population_says_so_instead_of_an_empty_model(tmp_path: Path) -> None:
    """A PopulationBased checkpoint holds the population, not a model: before the run's end
    there is no model to give (it used to read as an empty state_dict)."""
    doc = {**CASES["PopulationBased"], "run": {"name": "p", "seed": 3, "output_dir": str(tmp_path),
                                                "num_workers": 1}}
    run_dir = Path(paratrain.fit(doc)["run_dir"])
    assert paratrain.load_model(run_dir)  # finished: the best member's model
    (run_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has not finished"):
        paratrain.load_model(run_dir)
