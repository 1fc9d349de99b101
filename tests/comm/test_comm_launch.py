"""comm.launch: real processes through torch's elastic launcher (gloo on 127.0.0.1)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from paratrain.comm.launch import WorkerError, launch, reraise_worker_failure
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig
from paratrain.executors.entry import worker_entry

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _job(**run: object) -> JobConfig:
    return JobConfig.model_validate(
        {
            "run": {"name": "launch-test", **run},
            "workers": [{"id": "alpha", "tags": ["gpu", "big"]}],
        }
    )


def test_launch_two_processes_group_store_and_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # launch never picks a port beforehand (bind, close, bind again races with every
    # other socket on the machine): the rendezvous store binds port 0 itself.
    import paratrain.comm.testing as testing_mod

    def no_picking() -> int:
        raise AssertionError("launch must not pre-pick a port")

    monkeypatch.setattr(testing_mod, "free_port", no_picking)
    before = signal.getsignal(signal.SIGINT)
    out = launch(_job(), nprocs=2, entry=worker_entry, target="_workers_dp:launch_probe")
    # The elastic agent's SIGINT handler is gone again: Ctrl-C is a KeyboardInterrupt.
    assert signal.getsignal(signal.SIGINT) is before
    assert out["rank"] == 0 and out["world_size"] == 2
    assert out["sum"] == 3.0  # 1 + 2 through a real all-reduce
    assert out["peer"] == 10  # rank 1's value through the TCPStore control plane
    assert out["worker_id"] == "alpha" and out["tags"] == ["gpu", "big"]
    assert out["backend"] == "gloo" and out["threads"] == 1
    assert out["resume"] is False and out["restart_count"] == 0


def test_worker_error_surfaces_root_cause(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="boom from rank one: bad shard 42") as info:
        launch(_job(output_dir=str(tmp_path)), nprocs=2, entry=worker_entry, target="_workers_dp:launch_fail")
    assert info.value.rank == 1 and info.value.signal is None
    # The traceback is in the failed worker's log, and the one-line summary says where.
    log = tmp_path / "launch-test" / "worker-1.log"
    assert info.value.log == log
    text = log.read_text()
    assert "Traceback" in text and "_workers_dp.py" in text and "bad shard 42" in text
    assert info.value.summary() == f"ValueError: boom from rank one: bad shard 42 (worker 1; traceback in {log})"


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
        reraise_worker_failure(err)
    assert info.value.problems == [("strategy.num_replicas", "too many replicas (got 9)")]
    _record(monkeypatch, tmp_path / "b" / "attempt_0" / "0" / "error.json", ValueError("bad shard"))
    err = ChildFailedError(
        "worker_entry", {0: ProcessFailure(0, 1, 1, str(tmp_path / "b" / "attempt_0" / "0" / "error.json"))}
    )
    with pytest.raises(WorkerError, match="rank 0 failed: ValueError: bad shard"):
        reraise_worker_failure(err)


def test_torchrun_env_runs_in_process_and_checks_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="WORLD_SIZE=1"):
        launch(_job(), nprocs=2, entry=worker_entry, target="_workers_dp:launch_probe")


def test_a_killed_worker_is_the_cause_not_the_peer_that_lost_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 is SIGKILLed (no error file, exit -9); rank 0 then raises "connection
    reset" (an error file written first). The kill is the cause."""
    from paratrain.comm.launch import attempt_failures, root_failure

    _record(monkeypatch, tmp_path / "0" / "error.json",
            RuntimeError("[pair.cc:537] Read error [127.0.0.1]:53955: Connection reset by peer"))
    failures = attempt_failures({0: str(tmp_path / "0" / "error.json"), 1: ""}, {0: 0, 1: 1}, {1: -9})
    root = root_failure(failures)
    assert root is not None and (root.rank, root.signal) == (1, "SIGKILL")
    # The agent's own SIGTERM to a survivor is never the cause.
    root = root_failure(attempt_failures({}, {0: 0, 1: 1}, {0: -15, 1: -11}))
    assert root is not None and (root.rank, root.signal) == (1, "SIGSEGV")


def test_resume_point_is_what_the_executors_resume_from(tmp_path: Path) -> None:
    """The restart line names the checkpoint the stores resume from: the newest complete
    one of any layout (paratrain.files.newest_checkpoint), a population's generation too."""
    from paratrain.files import newest_checkpoint

    ckpts = tmp_path / "checkpoints"
    assert newest_checkpoint(tmp_path) is None
    for d, steps in (("dp-rank0", (4, 6)), ("dp-rank1", (2, 4))):
        (ckpts / d).mkdir(parents=True)
        for s in steps:
            (ckpts / d / f"ckpt-{s:09d}.pt").write_bytes(b"")
    assert newest_checkpoint(tmp_path) is None  # no marker: no step every rank completed
    (ckpts / "dp-complete.json").write_text('{"step": 4, "replicas": 2, "world": 2}')
    found = newest_checkpoint(tmp_path)
    assert found is not None and (found.kind, found.where) == ("dp", "step 4")
    (ckpts / "ckpt-000000003.pt").write_bytes(b"")  # an older Local checkpoint
    assert newest_checkpoint(tmp_path) == found
    (ckpts / "ckpt-000000007.pt").write_bytes(b"")  # a newer one (the run went on as Local)
    found = newest_checkpoint(tmp_path)
    assert found is not None and (found.kind, found.step) == ("local", 7)
    pbt = tmp_path / "pbt" / "checkpoints"
    pbt.mkdir(parents=True)
    (pbt / "population-000003.pt").write_bytes(b"")
    found = newest_checkpoint(pbt.parent)
    assert found is not None and found.where == "generation 3"  # was: "the start"

    # a Federated server's ckpt-<round>.pt has the Local file layout but holds a round
    fed = newest_checkpoint(tmp_path)
    assert fed is not None and fed.where_in("Federated") == "round 7"
    assert fed.where_in("Local") == fed.where == "step 7" and found.where_in("Federated") == "generation 3"

    # the lifecycle's step folders count the strategy's own unit
    for kind, unit in (("fed", "round"), ("pbt", "generation"), ("dp", "step")):
        run = tmp_path / kind
        folder = run / "checkpoints" / "step-000000009"
        folder.mkdir(parents=True)
        (folder / "layout.json").write_text(json.dumps({"kind": kind, "step": 9, "world": 2}))
        got = newest_checkpoint(run)
        assert got is not None and got.where == f"{unit} 9" and got.path == folder


def test_rendezvous_event_names_are_torchs_without_inspect_stack() -> None:
    # torch's own get_method_name, from a fresh copy of its module (launch replaces the
    # attribute in the loaded one): ours gives the same name at every depth, and past the
    # outermost frame.
    import importlib.util

    from paratrain.comm.rendezvous import cheap_event_names, get_method_name

    name = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    torch_s = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_s)

    def _record(fn: object, depth: int | None) -> str:
        return fn() if depth is None else fn(depth)  # type: ignore[operator]

    def next_rendezvous(fn: object, depth: int | None = None) -> str:
        return _record(fn, depth)

    for depth in (None, 0, 1, 3):
        assert next_rendezvous(get_method_name, depth) == next_rendezvous(torch_s.get_method_name, depth)
    assert next_rendezvous(get_method_name) == "next_rendezvous"
    assert get_method_name(100_000) == torch_s.get_method_name(100_000) == "no_method_name"
    cheap_event_names()
    assert importlib.import_module(name).get_method_name is get_method_name
