"""A user's plain nn.Module (skip connections, not a Sequential) under ModelParallel from a
TOML job file, node ids from named_modules(): it trains like the Local run and a SIGKILLed
worker restarts to the same parameters as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paratrain.config.job import JobConfig, load_job
from paratrain.dispatch import execute
from paratrain.executors.model_parallel.runner import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "model_parallel_residual.toml"


def _job(tmp: Path, name: str, *, local: bool = False, restarts: int = 0) -> JobConfig:
    doc = load_job(EXAMPLE).to_json_dict()
    doc["run"].update(name=name, output_dir=str(tmp), checkpoint_every=3, max_restarts=restarts,
                      imports=[str(EXAMPLE.parent / "residual_model.py")])
    doc["train"].update(epochs=1, max_steps=8, eval_every=4)
    if local:
        doc["strategy"] = {"type": "Local"}
        doc.pop("workers", None)
    return JobConfig.model_validate(doc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("res")
    return {"local": execute(_job(tmp, "local", local=True)), "mp": execute(_job(tmp, "mp")),
            "tmp": tmp}


def test_user_module_with_skips_runs_from_toml_and_matches_local(runs: dict[str, Any]) -> None:
    mp, local = runs["mp"], runs["local"]
    assert [s["worker"] for s in mp["stages"]] == ["worker-0", "worker-1", "worker-2"]
    assert mp["stages"][1]["nodes"][0] == "blocks.1.fc2"  # ids are named_modules() names
    assert mp["steps"] == local["steps"] == 8
    assert mp["test_loss"] == pytest.approx(local["test_loss"], rel=1e-4)
    assert mp["test_accuracy"] == pytest.approx(local["test_accuracy"], abs=1e-9)


def test_killed_worker_restarts_bit_identical(runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "2:5")  # rank 2 dies after step 5; checkpoint at step 3
    out = execute(_job(runs["tmp"], "killed", restarts=1))
    assert out["restart_count"] == 1 and out["resumed_from_step"] == 3
    assert out["parameters_sha256"] == runs["mp"]["parameters_sha256"]


REPLICATED = EXAMPLE.parent / "pipeline_replicated_stage.toml"


def _replicated(tmp: Path, name: str, *, restarts: int = 0, local: bool = False) -> JobConfig:
    doc = load_job(REPLICATED).to_json_dict()
    doc["run"].update(name=name, output_dir=str(tmp), checkpoint_every=3, max_restarts=restarts,
                      imports=[str(EXAMPLE.parent / "residual_model.py")])
    doc["model"]["width"] = 32
    doc["train"].update(epochs=1, max_steps=7, eval_every=7)
    if local:
        doc["strategy"] = {"type": "Local"}
        doc.pop("workers", None)
        doc["subgraphs"] = {}
    return JobConfig.model_validate(doc)


def test_replicated_stage_job_matches_local_and_resumes_bit_identical(
        runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = runs["tmp"]
    local = execute(_replicated(tmp, "rlocal", local=True))
    clean = execute(_replicated(tmp, "rclean"))
    assert clean["stages"][1]["replicas"] == ["worker-1", "worker-2"]
    assert clean["test_loss"] == pytest.approx(local["test_loss"], rel=1e-4)
    monkeypatch.setenv(FAULT_ENV, "2:4")  # the second replica dies after step 4
    killed = execute(_replicated(tmp, "rkilled", restarts=1))
    assert killed["restart_count"] == 1 and killed["resumed_from_step"] == 3
    assert killed["parameters_sha256"] == clean["parameters_sha256"]
