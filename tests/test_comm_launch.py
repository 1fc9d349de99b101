"""comm.launch: real processes through torch's elastic launcher (gloo on 127.0.0.1)."""

from __future__ import annotations

import pytest

from paratrain.comm.launch import WorkerError, launch
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig

pytestmark = pytest.mark.timeout(180)


def _job(**run: object) -> JobConfig:
    return JobConfig.model_validate(
        {
            "run": {"name": "launch-test", **run},
            "workers": [{"id": "alpha", "tags": ["gpu", "big"]}],
        }
    )


def test_launch_two_processes_group_store_and_workers() -> None:
    out = launch(_job(), nprocs=2, target="_workers_dp:launch_probe")
    assert out["rank"] == 0 and out["world_size"] == 2
    assert out["sum"] == 3.0  # 1 + 2 through a real all-reduce
    assert out["peer"] == 10  # rank 1's value through the TCPStore control plane
    assert out["worker_id"] == "alpha" and out["tags"] == ["gpu", "big"]
    assert out["backend"] == "gloo" and out["threads"] == 1
    assert out["resume"] is False and out["restart_count"] == 0


def test_worker_error_surfaces_root_cause() -> None:
    with pytest.raises(WorkerError, match="boom from rank one: bad shard 42") as info:
        launch(_job(), nprocs=2, target="_workers_dp:launch_fail")
    assert info.value.rank == 1


def test_config_error_in_worker_is_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        launch(_job(), nprocs=2, target="_workers_dp:launch_config_fail")
    assert info.value.problems == [("strategy.num_replicas", "too many replicas (got 9)")]


def test_torchrun_env_runs_in_process_and_checks_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="WORLD_SIZE=1"):
        launch(_job(), nprocs=2, target="_workers_dp:launch_probe")
