"""comm.launch: real processes through torch's elastic launcher (gloo on 127.0.0.1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from paratrain.comm.launch import WorkerError, _reraise, launch
from paratrain.comm.testing import free_port
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _job(**run: object) -> JobConfig:
    return JobConfig.model_validate(
        {
            "run": {"name": "launch-test", **run},
            "workers": [{"id": "alpha", "tags": ["gpu", "big"]}],
        }
    )


def test_launch_two_processes_group_store_and_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first "free" port is already taken (another job grabbed it): launch retries.
    import paratrain.comm.launch as launch_mod

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    calls: list[int] = []

    def first_taken() -> int:
        calls.append(1)
        return int(held.getsockname()[1]) if len(calls) == 1 else free_port()

    monkeypatch.setattr(launch_mod, "free_port", first_taken)
    try:
        out = launch(_job(), nprocs=2, target="_workers_dp:launch_probe")
    finally:
        held.close()
    assert len(calls) == 2  # the taken port failed the rendezvous, the second one worked
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


def _record(monkeypatch: pytest.MonkeyPatch, path: Path, exc: BaseException) -> None:
    """Write ``exc`` the way torch's elastic error handler does inside a worker."""
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    path.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        ErrorHandler().record_exception(e)


def test_root_cause_prefers_the_real_error_over_peer_fallout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent reports rank 0 (died of a closed connection); the cause is rank 1's
    ConfigError, found in the sibling error file and re-raised as a ConfigError."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    attempt = tmp_path / "attempt_0"
    _record(monkeypatch, attempt / "0" / "error.json",
            RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    _record(monkeypatch, attempt / "1" / "error.json",
            ConfigError([("strategy.num_replicas", "too many replicas (got 9)")]))
    err = ChildFailedError("worker_entry", {0: ProcessFailure(0, 1, 1, str(attempt / "0" / "error.json"))})
    with pytest.raises(ConfigError) as info:
        _reraise(err)
    assert info.value.problems == [("strategy.num_replicas", "too many replicas (got 9)")]
    _record(monkeypatch, tmp_path / "b" / "attempt_0" / "0" / "error.json", ValueError("bad shard"))
    err = ChildFailedError(
        "worker_entry", {0: ProcessFailure(0, 1, 1, str(tmp_path / "b" / "attempt_0" / "0" / "error.json"))}
    )
    with pytest.raises(WorkerError, match="rank 0 failed: ValueError: bad shard"):
        _reraise(err)


def test_torchrun_env_runs_in_process_and_checks_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="WORLD_SIZE=1"):
        launch(_job(), nprocs=2, target="_workers_dp:launch_probe")
