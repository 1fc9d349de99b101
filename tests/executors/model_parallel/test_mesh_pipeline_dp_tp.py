"""Pipeline x data parallel x tensor parallel on one mesh: 2 pipeline stages, the second
replicated twice (``[subgraphs.back] type = "DataParallel"``), every stage 2-way
tensor-parallel: 3 logical workers x tp 2 = 6 gloo ranks laid out ``worker 3 x tp 2``
(rank = worker*2 + tp), against the unpartitioned Local model on the same 16-row batches:

* 4 steps of SGD (momentum, weight decay) under 1F1B and of AdamW under GPipe and ZBH1, clipping active
  every step: the losses per step and the parameters equal Local's (rtol 1e-5). The two
  replicas of ``back`` each see half of every micro-batch's rows, so a missing sum over a dp
  group (ranks 2+4, 3+5), a loss not summed over the replicas, or a clipping norm counting a
  replica twice would each move the result;
* a run stopped at step 2 and resumed on the same mesh ends bit-identical; its checkpoint
  resumes on 4 ranks as pp x tp (the replica dropped) and on 3 as pp x dp (TP dropped), each
  time with the saved parameters;
* ``paratrain graph`` shows the mesh with its tp and dp groups; the launch asks for 6 processes.
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

RUNS = {"sgd-1F1B": {"optimizer": "sgd", "schedule": "1F1B"},
        "adamw-GPipe": {"optimizer": "adamw", "schedule": "GPipe"},
        "adamw-ZBH1": {"optimizer": "adamw", "schedule": "ZBH1"}}


@pytest.fixture(scope="module")
def mesh3d(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("pp_dp_tp"))
    resume = {"optimizer": "adamw", "checkpoint_every": 2}
    cases = [*((name, kw, False) for name, kw in RUNS.items()),
             ("full", resume, False), ("split", {**resume, "steps": 2}, False), ("split", resume, True),
             ("moved", {**resume, "steps": 2}, False)]
    ranks = run_distributed(runs_3d, 6, tmp, cases, timeout_s=380)
    return {"tmp": Path(tmp), "jobs": ranks[0]}


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_and_parameters_equal_the_unpartitioned_model(mesh3d: dict[str, Any], name: str) -> None:
    from paratrain.executors.local import run as run_local

    tmp = mesh3d["tmp"]
    run_local(job_3d(str(tmp), f"local-{name}", mesh=False, optimizer=RUNS[name]["optimizer"]))
    assert_matches(tmp / f"local-{name}", tmp / name)
    s = mesh3d["jobs"][name]
    # non-vacuity: 6 ranks on the worker x tp mesh, back replicated on workers 1 and 2, each
    # stage really sharded (front's pair on rank 0's stage; back's pair: the graph test)
    assert s["workers"] == 6 and s["mesh"]["layout"] == "rank = worker*2 + tp"
    assert s["mesh"]["groups"]["dp"] == [[2, 4], [3, 5]]
    assert s["stages"][1]["replicas"] == ["worker-1", "worker-2"]
    assert s["tensor_parallel_shards_per_stage"] >= 3  # front.0 weight + bias, front.2 weight


def test_resume_on_the_same_mesh_is_bit_identical(mesh3d: dict[str, Any]) -> None:
    jobs = mesh3d["jobs"]
    assert jobs["full"]["steps"] == jobs["split"]["steps"] == 4
    assert jobs["split"]["resumed_from_step"] == 2
    assert jobs["full"]["parameters_sha256"] == jobs["split"]["parameters_sha256"]


def test_a_checkpoint_resumes_resharded_onto_fewer_dimensions(mesh3d: dict[str, Any]) -> None:
    tmp = mesh3d["tmp"]
    before = _params(tmp / "moved")
    kw = {"optimizer": "adamw", "checkpoint_every": 2, "steps": 2}  # zero steps left: the saved state out
    for world, dims in ((4, {"replicas": 1}), (3, {"tp": 1})):
        (got,) = (r["moved"] for r in run_distributed(runs_3d, world, str(tmp), [("moved", {**kw, **dims}, True)],
                                                      timeout_s=200)[:1])
        assert got["steps"] == 2 and got["resumed_from"]["resharded"] is True, got.get("resumed_from")
        assert got["resumed_from"]["layout"]["world"] == 6  # both from the 3-D checkpoint
        after = _params(tmp / "moved")
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before), world


def test_graph_and_launch_show_the_mesh(tmp_path: Path) -> None:
    from _workers_mesh3d import FrontBack
    from paratrain.executors import spec_for
    from paratrain.executors.model_parallel.tp_stages import dry_shard
    from paratrain.executors.model_parallel.validation import validate
    from paratrain.explain import explain, render

    job = job_3d(str(tmp_path), "g", mesh=True)
    validate(job)
    assert dry_shard(job, FrontBack(10)) == [("front.0", "colwise"), ("front.2", "rowwise"),
                                             ("back.0", "colwise"), ("back.2", "rowwise")]
    assert spec_for(job).processes(job)[0] == 6  # (2 stages + 1 replica) x tp 2
    text = render(explain(job))
    assert "mesh worker 3 x tp 2: rank = worker*2 + tp" in text
    assert "tp groups: [0, 1] [2, 3] [4, 5]" in text and "dp groups: [2, 4] [3, 5]" in text


def test_the_example_validates_on_its_mesh() -> None:
    from paratrain.config.job import load_job
    from paratrain.executors import spec_for
    from paratrain.explain import explain_file, render
    from paratrain.preflight import preflight

    path = Path(__file__).resolve().parents[3] / "examples" / "pipeline_dp_tp.toml"
    job = load_job(path)
    preflight(job, job_dir=path.parent)  # the plan's patterns match, the stages shard
    assert spec_for(job).processes(job)[0] == 6
    assert "dp groups: [2, 4] [3, 5]" in render(explain_file(path))
