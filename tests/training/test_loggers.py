"""Experiment trackers (``run.loggers``) read back by each library's own reader: a Local run
SIGKILLed after step 61 (checkpoint at step 50) and resumed with ``--resume`` writes to
TensorBoard, MLflow's file store and W&B offline at once; each holds the training curve
(at least 100 points), the evaluation metrics and the job, with no step logged twice."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from paratrain.training import read_metrics
from paratrain.training.faults import FAULT_ENV
from paratrain.training.loggers import wandb_records

ROOT = Path(__file__).resolve().parents[2]
# Found, not imported, at collection: every pytest worker collects every file, and MLflow and
# W&B take 2.4 s of CPU to import; the tests import them where they read the records back.
_MISSING = [m for m in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {_MISSING}")]
KILL_AFTER = 61


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("trackers")
    doc = {"run": {"name": "tracked", "seed": 3, "output_dir": str(tmp), "progress_every": "off",
                   "checkpoint_every": 25, "log_every": 1,
                   "loggers": ["tensorboard", "mlflow", "wandb"]},
           "model": {"name": "mlp", "hidden": [16]},
           "train": {"epochs": 3, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.1}}}
    job = tmp / "tracked.json"
    job.write_text(json.dumps(doc))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "paratrain.cli", "run", "-q", str(job)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, FAULT_ENV: f"0:{KILL_AFTER}"}, timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "tracked"


def _expected(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """metrics.jsonl's curve (step -> train_loss) and evaluations (step -> test_loss)."""
    recs = read_metrics(run_dir, train=True)
    curve = {r["step"]: r["train_loss"] for r in recs if r.get("kind") == "train"}
    evals = {r["step"]: r["test_loss"] for r in recs if "test_loss" in r}
    assert len(curve) >= 100 and len(evals) == 3
    return curve, evals


def test_tensorboard(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    curve, evals = _expected(run_dir)
    loss = acc.Scalars("train/loss")
    steps = [e.step for e in loss]
    assert steps == sorted(curve) and len(set(steps)) == len(steps), "purged after the resume point"
    assert [e.value for e in loss] == pytest.approx([curve[s] for s in steps], rel=1e-6)
    for tag in ("train/lr", "train/steps_per_s", "train/samples_per_s", "train/step_time_s", "train/memory_mb"):
        assert [e.step for e in acc.Scalars(tag)] == steps, tag
    assert {e.step: e.value for e in acc.Scalars("test_loss")} == pytest.approx(evals, rel=1e-6)
    assert "test_accuracy" in acc.Tags()["scalars"] and "job/text_summary" in acc.Tags()["tensors"]


def test_mlflow(run_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("paratrain")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, "the resumed run continued the same MLflow run"
    run = runs[0]
    assert run.info.run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    curve, evals = _expected(run_dir)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    steps = [m.step for m in history]
    assert Counter(steps).most_common(1)[0][1] == 1, "no step twice"
    # steps 51..61 were logged by the killed run and not again; their values are the same
    assert sorted(steps) == sorted(curve)
    assert {m.step: m.value for m in history} == pytest.approx(curve)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "test_loss")} == pytest.approx(evals)
    assert len(client.get_metric_history(run.info.run_id, "train/lr")) == len(curve)
    assert run.data.params["run.name"] == "tracked" and run.data.params["train.batch_size"] == "32"


def test_wandb_offline(run_dir: Path) -> None:
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    files = sorted(glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb")))
    assert len(files) == 2, "the killed run's file and the resumed run's, one W&B run id"
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for f in files:
        for rec in wandb_records(Path(f)):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "run":
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    curve, evals = _expected(run_dir)
    steps = [r["_step"] for r in rows]
    assert len(set(steps)) == len(steps), "no step twice"
    got = {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert got == pytest.approx(curve)
    assert {r["_step"]: r["test_loss"] for r in rows if "test_loss" in r} == pytest.approx(evals)
    assert all("train/lr" in r and "train/memory_mb" in r for r in rows if "train/loss" in r)
    assert config["run"]["name"] == "tracked" and config["train"]["batch_size"] == 32


def _scalars(run: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return acc


def test_federated_per_round_with_epsilon_and_population_per_member(tmp_path: Path) -> None:
    from test_pbt_task import regression_job

    from _workers_federated import fed_job
    from paratrain.executors.federated import run_in_process
    from paratrain.executors.population_based import runner as population

    fed = fed_job(tmp_path, "fed", K=6, rounds=2, local_epochs=1, dp={"clip": 0.5, "noise_multiplier": 0.3})
    fed = fed.model_copy(update={"run": fed.run.model_copy(update={"loggers": ["tensorboard"]})})
    s = run_in_process(fed)
    acc = _scalars(Path(s["run_dir"]))
    rounds = {r["round"]: r for r in read_metrics(s["run_dir"])}
    for tag in ("test_loss", "test_accuracy", "epsilon", "train_loss"):
        assert {e.step: e.value for e in acc.Scalars(tag)} == pytest.approx(
            {n: r[tag] for n, r in rounds.items()}, rel=1e-6), tag
    assert sorted(rounds) == [1, 2]

    pbt = regression_job(tmp_path, "pbt")
    pbt = pbt.model_copy(update={"run": pbt.run.model_copy(update={"loggers": ["tensorboard"]})})
    s = population.run(pbt)
    acc = _scalars(Path(s["run_dir"]))
    for r in read_metrics(s["run_dir"]):
        m, g = r["member"], r["generation"]
        assert {e.step: e.value for e in acc.Scalars(f"member_{m}/test_mse")}[g] == pytest.approx(r["test_mse"])
        assert {e.step: e.value for e in acc.Scalars(f"member_{m}/hparams/lr")}[g] == pytest.approx(r["hparams"]["lr"])


def test_data_parallel_one_writer(tmp_path: Path) -> None:
    """Two DataParallel ranks (each curve point a collective mean over the replicas, at
    logging steps only): one event file, rank 0's, holding metrics.jsonl's curve."""
    from paratrain.config import load_job
    from paratrain.executors.data_parallel import runner as dp

    doc: dict[str, Any] = load_job(ROOT / "examples" / "data_parallel_digits.toml").to_json_dict()
    doc["run"].update(name="dp", output_dir=str(tmp_path), log_every=3, loggers=["tensorboard"],
                      progress_every="off")
    doc["train"].update(epochs=1, max_steps=12, eval_every=6)
    s = dp.run(load_job(doc))
    run = Path(s["run_dir"])
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    curve = {r["step"]: r["train_loss"] for r in read_metrics(run, train=True) if r.get("kind") == "train"}
    assert sorted(curve) == [3, 6, 9, 12]
    assert {e.step: e.value for e in _scalars(run).Scalars("train/loss")} == pytest.approx(curve, rel=1e-6)
