"""Interleaved1F1B with a replicated worker: worker-1 runs two non-adjacent chunks (``b.p``,
``b.q``, both under ``b``), ``[subgraphs.b]`` replicates them on a third worker, so each
micro-batch's rows are split between worker-1 and worker-2 at both of worker-1's chunks.
On 3 gloo processes against the unpartitioned Local model (AdamW, clipping every step): the
per-step losses and parameters are equal (rtol 1e-5), with the stage unsharded and with
ZeRO-2 over its replicas; a stopped run resumes bit-identically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_mesh_pipeline_tp import assert_matches

from _workers_mp_interleaved_dp import job_il, runs_il
from paratrain.comm.testing import run_distributed

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("il_dp"))
    resume = {"checkpoint_every": 2}
    cases = [("plain", {}, False), ("zero2", {"shard": "gradients"}, False),
             ("full", resume, False), ("split", {**resume, "steps": 2}, False), ("split", resume, True)]
    ranks = run_distributed(runs_il, 3, tmp, cases, timeout_s=250)
    return {"tmp": Path(tmp), "jobs": ranks[0]}


@pytest.mark.parametrize("name", ["plain", "zero2"])
def test_equals_the_unpartitioned_model(interleaved: dict[str, Any], name: str) -> None:
    from paratrain.executors.local import run as run_local

    tmp = interleaved["tmp"]
    run_local(job_il(str(tmp), f"local-{name}", mesh=False))
    assert_matches(tmp / f"local-{name}", tmp / name)
    s = interleaved["jobs"][name]
    assert s["schedule"] == "Interleaved1F1B"
    assert [st.get("replicas") for st in s["stages"]] == [None, ["worker-1", "worker-2"]] * 2


def test_resume_is_bit_identical(interleaved: dict[str, Any]) -> None:
    jobs = interleaved["jobs"]
    assert jobs["split"]["resumed_from_step"] == 2
    assert jobs["full"]["parameters_sha256"] == jobs["split"]["parameters_sha256"]
