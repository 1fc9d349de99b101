"""Pipeline x tensor parallelism on one mesh: 2 pipeline stages x 2-way TP inside each
stage on 4 gloo ranks laid out ``pp 2 x tp 2`` (rank = stage*2 + tp), against the
unpartitioned Local model on the same 16-row batches:

* 4 steps of SGD (momentum, weight decay) under 1F1B and Interleaved1F1B (4 chunks, 2 a
  worker) and of AdamW under GPipe and ZBH1 (backward split into B and W), with clipping
  active every step: the losses per step and the parameters equal Local's (rtol 1e-5).
  SGD's update scales with the clipping coefficient, so a norm taken over one stage or one
  TP rank, or counting the replicated head twice, would move it;
* a run stopped at step 2 and resumed on the same mesh ends bit-identical;
* every schedule validates and the launch asks for stages x tp processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_mesh import pipeline_job, pipeline_runs
from paratrain.comm.testing import run_distributed
from paratrain.training import read_metrics

pytestmark = [pytest.mark.timeout(300)]

RUNS = {"sgd-1F1B": {"optimizer": "sgd", "schedule": "1F1B"},
        "adamw-GPipe": {"optimizer": "adamw", "schedule": "GPipe"},
        "sgd-Interleaved1F1B": {"optimizer": "sgd", "schedule": "Interleaved1F1B"},
        "adamw-ZBH1": {"optimizer": "adamw", "schedule": "ZBH1"}}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("pp_tp"))
    resume = {"optimizer": "adamw", "checkpoint_every": 2}
    cases = [(name, kw, False) for name, kw in RUNS.items()]
    cases += [("full", resume, False), ("split", {**resume, "steps": 2}, False), ("split", resume, True)]
    ranks = run_distributed(pipeline_runs, 4, tmp, cases, timeout_s=280)
    return {"tmp": Path(tmp), "jobs": ranks[0]}


def _params(path: Path) -> dict[str, torch.Tensor]:
    from paratrain.training.export import read_model

    return read_model(path / "model.safetensors")


def _losses(path: Path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(path)]  # the evaluation records


def assert_matches(ref_dir: Path, run_dir: Path, steps: int = 4) -> None:
    """The run's exported parameters and per-step losses equal the reference run's (rtol 1e-5)."""
    ref, got = _params(ref_dir), _params(run_dir)
    assert list(got) == list(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    ref_loss = _losses(ref_dir)
    assert len(ref_loss) == steps
    torch.testing.assert_close(torch.tensor(_losses(run_dir)), torch.tensor(ref_loss), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_and_parameters_equal_the_unpartitioned_model(pipeline: dict[str, Any], name: str) -> None:
    from paratrain.executors.local import run as run_local

    tmp = pipeline["tmp"]
    run_local(pipeline_job(str(tmp), f"local-{name}", tp=0, optimizer=RUNS[name]["optimizer"]))
    assert_matches(tmp / f"local-{name}", tmp / name)
    s = pipeline["jobs"][name]
    assert s["strategy"] == "ModelParallel" and s["schedule"] == RUNS[name]["schedule"]
    # non-vacuity: the stages really ran tensor-parallel on the pp x tp mesh (rank 0's stage
    # holds fc0's column shards: weight and bias)
    assert s["mesh"]["layout"] == "rank = pp*2 + tp" and s["tensor_parallel_shards_per_stage"] >= 2


def test_resume_on_the_same_mesh_is_bit_identical(pipeline: dict[str, Any]) -> None:
    jobs = pipeline["jobs"]
    assert jobs["full"]["steps"] == jobs["split"]["steps"] == 4
    assert jobs["full"]["parameters_sha256"] == jobs["split"]["parameters_sha256"]
    assert jobs["split"]["tensor_parallel_size"] == 2  # the resumed run is the sharded one


def test_process_count(tmp_path: Path) -> None:
    from paratrain.executors import spec_for
    from paratrain.executors.model_parallel.validation import validate

    for schedule in ("1F1B", "ZBH1", "Interleaved1F1B"):
        job = pipeline_job(str(tmp_path), "n", tp=2, schedule=schedule)
        validate(job)
        assert spec_for(job).processes(job)[0] == 4  # 2 stages x tp 2


def test_graph_shows_the_pp_x_tp_mesh(tmp_path: Path) -> None:
    from paratrain.explain import explain, render

    text = render(explain(pipeline_job(str(tmp_path), "g", tp=2)))
    assert "mesh pp 2 x tp 2: rank = pp*2 + tp" in text
    assert "tp groups: [0, 1] [2, 3]" in text and "pp groups: [0, 2] [1, 3]" in text
    assert "worker-2" not in text  # one worker a stage; the tp ranks are the mesh's
