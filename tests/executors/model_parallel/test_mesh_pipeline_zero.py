"""ZeRO inside a replicated pipeline stage (``[subgraphs.back] type = "DataParallel",
num_replicas = 2, shard = "optimizer" | "gradients" | "parameters"``): 2 pipeline stages, ``back`` run by
2 replicas that each step only their rows of its parameters, on 3 gloo ranks (and, with
2-way tensor parallelism in every stage, on 6), against the unpartitioned Local model:

* 4 steps under 1F1B, ZBH1 and GPipe, SGD with momentum and AdamW, clipping active every
  step: per-step losses and parameters equal Local's (rtol 1e-5). A replica that stepped
  its rows with its own gradient, skipped the all-gather, or counted rows twice in the
  clipping norm would each move the result; ZeRO-3 also with 2-way tensor parallelism;
* the optimizer state each replica of ``back`` holds (measured from its tensors) is half
  the unsharded replicated stage's, ZeRO-2 also halves the gradients it keeps, and ZeRO-3
  the parameters it holds between steps;
* a ZeRO-3 run stopped at step 2 and resumed ends bit-identical; a checkpoint (each
  replica's rows, by the model's names) resumes unsharded on 3 ranks and on 2 (no
  replica) with the saved parameters;
* ``shard_unit`` is refused, naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_mesh_pipeline_tp import _params, assert_matches

from _workers_mesh3d import job_3d, runs_3d
from paratrain.comm.testing import run_distributed

pytestmark = [pytest.mark.timeout(400)]

RUNS = {"z1-adamw-1F1B": {"optimizer": "adamw", "schedule": "1F1B", "shard": "optimizer"},
        "z2-adamw-ZBH1": {"optimizer": "adamw", "schedule": "ZBH1", "shard": "gradients"},
        "z2-sgd-GPipe": {"optimizer": "sgd", "schedule": "GPipe", "shard": "gradients"},
        "z3-adamw-ZBH1": {"optimizer": "adamw", "schedule": "ZBH1", "shard": "parameters"},
        "z3-sgd-1F1B": {"optimizer": "sgd", "schedule": "1F1B", "shard": "parameters"}}
BASE = {"tp": 1}


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("pp_zero"))
    resume = {**BASE, "optimizer": "adamw", "checkpoint_every": 2, "shard": "parameters"}
    cases = [*((name, {**BASE, **kw}, False) for name, kw in RUNS.items()),
             ("plain", {**BASE, "optimizer": "adamw"}, False),
             ("full", resume, False), ("split", {**resume, "steps": 2}, False), ("split", resume, True),
             ("moved", {**resume, "shard": "optimizer", "steps": 2}, False)]
    ranks = run_distributed(runs_3d, 3, tmp, cases, timeout_s=380)
    return {"tmp": Path(tmp), "jobs": ranks[0]}


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The unpartitioned Local run's folder for an optimizer, run once (``job_3d(mesh=False)``
    depends on nothing else: schedule, shard and tp describe the mesh)."""
    from paratrain.executors.local import run as run_local

    tmp, done = tmp_path_factory.mktemp("local"), {}

    def get(optimizer: str) -> Path:
        if optimizer not in done:
            run_local(job_3d(str(tmp), f"local-{optimizer}", mesh=False, optimizer=optimizer))
            done[optimizer] = tmp / f"local-{optimizer}"
        return done[optimizer]
    return get


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_and_parameters_equal_the_unpartitioned_model(
        staged: dict[str, Any], local: Any, name: str) -> None:
    assert_matches(local(RUNS[name]["optimizer"]), staged["tmp"] / name)
    assert staged["jobs"][name]["stages"][1]["replicas"] == ["worker-1", "worker-2"]


def test_each_replica_holds_half_the_stage_optimizer_state(staged: dict[str, Any]) -> None:
    def held(name: str, rank: int) -> dict[str, int]:
        return dict(staged["jobs"][name]["stage_stats"][rank]["held_bytes_measured"])

    back = 16 * 16 + 16 + 16 * 10 + 10  # back's parameters
    plain = held("plain", 1)
    assert plain["optimizer"] >= 2 * 4 * back and plain["gradients"] == 4 * back
    for rank in (1, 2):  # both replicas of back (16 and 10 rows: an even split)
        z1, z2, z3 = held("z1-adamw-1F1B", rank), held("z2-adamw-ZBH1", rank), held("z3-adamw-ZBH1", rank)
        assert z1["parameters"] == z2["parameters"] == plain["parameters"] == 4 * back
        for z in (z1, z2, z3):  # Adam's two moments of this replica's rows (+ the 4 step counters)
            assert z["optimizer"] == 2 * 4 * back // 2 + (plain["optimizer"] - 2 * 4 * back)
        assert z1["gradients"] == 4 * back  # ZeRO-1 keeps the whole gradient
        assert z2["gradients"] == z3["gradients"] == 4 * back // 2  # ZeRO-2/3 only its rows
        assert z3["parameters"] == 4 * back // 2  # ZeRO-3: its rows between steps
    assert held("z2-adamw-ZBH1", 0) == held("plain", 0)  # front is not replicated: whole


def test_resume_is_bit_identical_and_reshards(staged: dict[str, Any]) -> None:
    jobs, tmp = staged["jobs"], staged["tmp"]
    assert jobs["full"]["steps"] == jobs["split"]["steps"] == 4
    assert jobs["split"]["resumed_from_step"] == 2
    assert jobs["full"]["parameters_sha256"] == jobs["split"]["parameters_sha256"]
    before = _params(tmp / "moved")
    kw = {**BASE, "optimizer": "adamw", "checkpoint_every": 2, "steps": 2}  # nothing left: the saved state
    for world, dims in ((3, {}), (2, {"replicas": 1})):
        (got,) = (r["moved"] for r in run_distributed(runs_3d, world, str(tmp), [("moved", {**kw, **dims}, True)],
                                                      timeout_s=200)[:1])
        assert got["steps"] == 2 and got["resumed_from"]["resharded"] is True, got.get("resumed_from")
        after = _params(tmp / "moved")
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before), world


def test_with_tensor_parallel_stages_equals_the_unpartitioned_model(tmp_path: Path, local: Any) -> None:
    run_distributed(runs_3d, 6, str(tmp_path), [
        ("z3-tp", {"optimizer": "adamw", "schedule": "1F1B", "shard": "parameters"}, False)], timeout_s=300)
    assert_matches(local("adamw"), tmp_path / "z3-tp")


@pytest.mark.parametrize(("extra", "field"), [({"shard": "gradients", "shard_unit": ["0"]},
                                               "subgraphs.back.shard_unit")])
def test_what_a_stage_cannot_shard_is_refused(tmp_path: Path, extra: dict[str, Any], field: str) -> None:
    from paratrain.config import ConfigError, load_job
    from paratrain.executors.model_parallel.validation import validate

    doc = job_3d(str(tmp_path), "r", mesh=True, tp=1).model_dump(mode="json", exclude_none=True)
    doc["subgraphs"]["back"].update(extra)
    with pytest.raises(ConfigError) as err:
        validate(load_job(doc))
    assert field in str(err.value)


def test_graph_shows_the_stage_shard(tmp_path: Path) -> None:
    from paratrain.executors.model_parallel.validation import validate
    from paratrain.explain import explain, render

    job = job_3d(str(tmp_path), "g", mesh=True, tp=1, shard="gradients")
    validate(job)
    report = explain(job)
    (back,) = [g for g in report["subgraphs"] if g["subgraph"] == "back"]
    assert back["shard"] == "gradients" and back["workers"] == ["worker-1", "worker-2"]
    assert "DataParallel (own, shard = gradients)" in render(report)
