"""Kill and resume, bit-identical, for the any-topology placements of test_mp_graph: the
tied GPT cut mid-block (its embedding weight read on another worker) and two towers on two
workers joined on a third (a user model factory), each SIGKILLed and restarted by the
elastic agent from its last checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paratrain.config.job import JobConfig
from paratrain.dispatch import execute
from paratrain.executors.model_parallel.runner import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _p(ids: list[str], w: int) -> dict[str, Any]:
    return {"node_ids": ids, "target": {"WorkerId": f"worker-{w}"}}


JOBS = {
    # strided blocks: a test split of 1,042 blocks, not 33,328 (each run evaluates it)
    "gpt": {"task": {"name": "language_model", "block_size": 16, "stride": 512}, "data": {"name": "shakespeare"},
            "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16},
            "strategy": {"type": "ModelParallel",
                         "communication": {"protocol": "Pipeline", "micro_batch_size": 3,
                                           "schedule": "1F1B"},
                         "partitions": [_p(["block0.mlp", "block1", "ln_f", "head"], 1)]},
            "run": {"num_workers": 2}, "kill": "1:4"},
    "towers": {"model": {"factory": "_workers_mp_graph:towers"},
               "strategy": {"type": "ModelParallel", "communication": {"protocol": "Direct"},
                            "partitions": [_p(["net.right"], 1), _p(["net.join"], 2)]},
               "run": {"num_workers": 3}, "kill": "2:4"},
}


def _job(tmp: Path, kind: str, name: str, restarts: int = 0) -> JobConfig:
    spec = {k: v for k, v in JOBS[kind].items() if k != "kill"}
    run = {"name": name, "seed": 5, "output_dir": str(tmp), "checkpoint_every": 3,
           "max_restarts": restarts, **spec.pop("run")}
    return JobConfig.model_validate({
        **spec, "run": run,
        "train": {"epochs": 1, "batch_size": 8, "max_steps": 7, "eval_every": 7,
                  "grad_clip_norm": 1.0, "optimizer": {"name": "adamw", "lr": 0.003}}})


@pytest.mark.parametrize("kind", sorted(JOBS))
def test_killed_any_topology_job_restarts_bit_identical(kind: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    clean = execute(_job(tmp_path, kind, "clean"))
    assert clean["steps"] == 7 and len(clean["stages"]) == JOBS[kind]["run"]["num_workers"]
    monkeypatch.setenv(FAULT_ENV, JOBS[kind]["kill"])
    killed = execute(_job(tmp_path, kind, "killed", restarts=1))
    assert killed["restart_count"] == 1 and killed["resumed_from_step"] == 3
    assert killed["parameters_sha256"] == clean["parameters_sha256"]
