"""comm/p2p.py DataStore sessions: two runs of one ``run.name`` in different ``run.output_dir``
that share one DataStore path are different runs; a launch removes only its own run's
earlier sessions, never the other run's live one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.comm.p2p import open_session
from paratrain.config.job import JobConfig
from paratrain.dispatch import execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _job(out: Path, shared: Path) -> JobConfig:
    return JobConfig.model_validate({
        "run": {"name": "same", "seed": 3, "output_dir": str(out)},
        "model": {"name": "mlp", "hidden": [32, 16]},
        "train": {"epochs": 1, "batch_size": 24, "max_steps": 2,
                  "optimizer": {"name": "sgd", "lr": 0.05}},
        "strategy": {"type": "ModelParallel",
                     "communication": {"protocol": "DataStore", "path": str(shared)},
                     "partitions": [{"node_ids": ["fc0", "act0", "head"],
                                     "target": {"WorkerId": "worker-1"}}]},
    })


def _sessions(shared: Path) -> set[str]:
    return {p.name for p in shared.iterdir() if p.is_dir()}


def test_a_run_of_the_same_name_elsewhere_keeps_its_live_session(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    run_a, run_b = tmp_path / "a" / "same", tmp_path / "b" / "same"
    # Run A (output_dir a/) is mid-run: its session holds a value not yet consumed.
    live = open_session(shared, rank=0, namespace="same", run_dir=run_a)
    live.put("s000000001-act-m0-g1-0to1", torch.ones(3))
    # Run B's own session from an earlier (crashed) launch: stale, B removes it.
    stale = open_session(shared, rank=0, namespace="same", run_dir=run_b)
    assert live.root.parent == stale.root.parent == shared and live.root.name != stale.root.name
    assert re.fullmatch(r"same-[0-9a-f]{12}\.session-[0-9a-f]{12}", live.root.name)

    out: dict[str, Any] = execute(_job(tmp_path / "b", shared))

    assert out["steps"] == 2
    assert live.root.is_dir() and torch.equal(live.take("s000000001-act-m0-g1-0to1"), torch.ones(3))
    assert not stale.root.exists()
    assert _sessions(shared) == {live.root.name}  # B's own session removed at its end
