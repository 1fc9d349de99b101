"""DataParallel under ``[fault_tolerance]`` (torchft), in torchft's own style: replica groups
(one process each) on gloo with a real Lighthouse on 127.0.0.1, a group SIGKILLed at a chosen
step (``PARATRAIN_FAULT_KILL``, first attempt only):

* with every group alive the parameters equal plain DataParallel's, bit for bit;
* a group killed mid-run is restarted alone (the other's restart count stays 0), heals from
  the live peer (not from its disk checkpoint, which is older) and every group ends with the
  same parameters;
* group 0 restarted after its peers took the last step (held until they ended) finds the
  run ended and exits cleanly; the group that took the last step writes the model, the
  summary and the final checkpoint;
* with ``min_replicas`` more than the groups alive, the quorum timeout fails the run with a
  clear error within ``quorum_timeout_s`` plus slack, not a hang;
* a bad ``[fault_tolerance]`` is a ConfigError naming the field.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.comm.launch import WorkerError
from paratrain.config import ConfigError, load_job
from paratrain.config.effective import effective_settings
from paratrain.executors.data_parallel import fault_tolerance as ft
from paratrain.executors.data_parallel import runner as dp
from paratrain.training.faults import HOLD_RESTART_ENV
from paratrain.training.stores import read_rank_state

pytestmark = [pytest.mark.timeout(300)]


def _job(tmp: Path, name: str, *, ft_table: dict[str, Any] | None = None, **run: Any) -> Any:
    doc: dict[str, Any] = {
        "run": {"name": name, "output_dir": str(tmp), "seed": 3, "progress_every": "off", **run},
        "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": 24, "eval_every": 0,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
    }
    if ft_table is not None:
        doc["fault_tolerance"] = {"quorum_timeout_s": 60, "join_timeout_s": 0.5,
                                  "heartbeat_timeout_s": 2.0, **ft_table}
    return load_job(doc)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain DataParallel's summary of the job (no [fault_tolerance])."""
    return dp.run(_job(tmp_path_factory.mktemp("plain"), "plain"))


def test_every_group_alive_equals_plain_data_parallel(tmp_path: Path, plain: dict[str, Any]) -> None:
    tolerant = ft.run(_job(tmp_path, "ft", ft_table={}))
    assert tolerant["steps"] == plain["steps"] == 24
    assert tolerant["fault_tolerance"]["restarts"] == [0, 0]
    assert tolerant["fault_tolerance"]["parameters_sha256_by_replica"] == [plain["parameters_sha256"]] * 2
    assert tolerant["parameters_sha256"] == plain["parameters_sha256"]


def test_killed_group_restarts_alone_and_heals_from_a_live_peer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # group 1 dies after step 9; its disk checkpoint is step 8's (group 0 writes every 4);
    # min_replicas = 2: group 0 waits at step 10's quorum for the restarted group
    monkeypatch.setenv(dp.FAULT_ENV, "1:9")
    job = _job(tmp_path, "kill", ft_table={"min_replicas": 2}, max_restarts=1, checkpoint_every=4)
    summary = ft.run(job)
    run_dir = Path(summary["run_dir"])
    assert summary["steps"] == 24 and summary["restart_count"] == 0
    assert summary["fault_tolerance"]["restarts"] == [0, 1]  # the other group was not restarted
    digests = summary["fault_tolerance"]["parameters_sha256_by_replica"]
    assert digests == [summary["parameters_sha256"]] * 2  # every replica's state equal
    healed = json.loads((run_dir / "replica-1.json").read_text())
    assert healed["restart_count"] == 1 and healed["steps"] == 24
    # healed from the live peer's step 9, past the step-8 checkpoint it had read from disk
    assert healed["resumed_from"]["checkpoint"] == "a live peer"
    assert healed["resumed_from"]["step"] == 9
    survivor = json.loads((run_dir / "replica-0.json").read_text())
    assert survivor["restart_count"] == 0 and survivor["resumed_from"] is None
    assert survivor["steps_short_of_groups"] == 0  # no step committed without group 1


def test_survivor_goes_on_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # min_replicas = 1 and no restart: group 1's shard of steps 4..24 is never trained,
    # those steps average over group 0 alone
    monkeypatch.setenv(dp.FAULT_ENV, "1:3")
    summary = ft.run(_job(tmp_path, "alone", ft_table={"min_replicas": 1}, max_restarts=0))
    assert summary["steps"] == 24 and summary["fault_tolerance"]["restarts"] == [0, 0]
    assert summary["fault_tolerance"]["parameters_sha256_by_replica"] == [summary["parameters_sha256"], None]
    survivor = json.loads((Path(summary["run_dir"]) / "replica-0.json").read_text())
    assert survivor["steps_short_of_groups"] == 24 - 3


def test_group_0_restarted_after_its_peers_finished_leaves_the_records_to_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # group 0 dies after step 23 of 24 and is restarted, held (PARATRAIN_FAULT_HOLD_RESTART)
    # until group 1, alone at step 24 (min_replicas = 1), has ended: group 1 took the last
    # step, so it writes the model, the summary and the final checkpoint; the restarted group
    # 0 finds the run ended (no peer to heal from) and exits cleanly, writing nothing
    monkeypatch.setenv(dp.FAULT_ENV, "0:23")
    monkeypatch.setenv(HOLD_RESTART_ENV, "replica-1.json")
    summary = ft.run(_job(tmp_path, "late", ft_table={"min_replicas": 1}, max_restarts=1, checkpoint_every=8))
    run_dir = Path(summary["run_dir"])
    assert summary["steps"] == 24 and summary["fault_tolerance"]["restarts"] == [1, 0]
    # the restart exited 0: no error logged, not given up as lost
    assert not (run_dir / "worker-0.log").exists() and not (run_dir / ".replica-0-lost").exists()
    last = json.loads((run_dir / "replica-1.json").read_text())
    assert last["steps"] == 24 and last["steps_short_of_groups"] == 1 and last["restart_count"] == 0
    assert summary["fault_tolerance"]["parameters_sha256_by_replica"] == [None, last["parameters_sha256"]]
    assert summary["parameters_sha256"] == last["parameters_sha256"] and summary["restart_count"] == 0
    final = read_rank_state(run_dir / "checkpoints" / "step-000000024", 0)  # group 1's state after step 24
    assert final["step"] == 24
    model = _params(run_dir)
    assert model.keys() == final["model"].keys()
    assert all(torch.equal(model[k], final["model"][k]) for k in model)


def _params(run_dir: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


@pytest.mark.parametrize(("kill", "restarts"), [("1:3", 0), ("0:5", 0), ("1:9", 1)])
def test_replay_trains_the_lost_shards_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             plain: dict[str, Any], kill: str, restarts: int) -> None:
    # membership schedules: a group gone for good after step 3 (group 1) or 5 (group 0, so
    # group 1 writes the model and summary), or gone after step 9 until it heals and rejoins;
    # with replay the groups alive train the missing shards of every step, so the run ends
    # with the failure-free parameters (plain DataParallel's; the sums' order differs)
    monkeypatch.setenv(dp.FAULT_ENV, kill)
    table = {"min_replicas": 1, "replay": True}
    summary = ft.run(_job(tmp_path, "replay", ft_table=table, max_restarts=restarts))
    assert summary["steps"] == 24
    assert sorted(summary["fault_tolerance"]["restarts"]) == [0, restarts]
    if not restarts:
        survivor = 1 - int(kill[0])
        record = json.loads((Path(summary["run_dir"]) / f"replica-{survivor}.json").read_text())
        assert record["steps_short_of_groups"] == 24 - int(kill[2:])
    got, want = _params(summary["run_dir"]), _params(plain["run_dir"])
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6)


def run_and_join(job: Any, group: int, timeout_s: float = 180) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``ft.run(job)`` in a thread; once its training logged, replica group ``group`` joins
    (``ft.join_group``); returns both summaries when the run ended."""
    import threading

    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(ft.run(job)))
    runner.start()
    _training_began(Path(job.run.output_dir) / job.run.name)
    joined = ft.join_group(job, group)
    runner.join(timeout_s)
    return result, joined


def _training_began(run_dir: Path) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and '"kind": "train"' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the run's own output


def test_elastic_a_group_joins_and_one_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 shards, 2 groups started; group 2 joins once training logged; group 1 leaves for good
    # after step 30; min_replicas = 2 holds group 0 at step 31 until group 2 is in. With
    # replay the groups alive train the absent shards: the 3-replica failure-free parameters
    doc = _job(tmp_path, "elastic", ft_table={"min_replicas": 2, "groups": 2, "replay": True},
               max_restarts=0, log_every=10).to_json_dict()
    doc["strategy"]["num_replicas"] = 3
    doc["train"].update(max_steps=48, epochs=100)
    job = load_job(doc)
    plain_doc = {**doc, "run": {**doc["run"], "name": "plain3"}}
    del plain_doc["fault_tolerance"]
    want = _params(dp.run(load_job(plain_doc))["run_dir"])
    monkeypatch.setenv(dp.FAULT_ENV, "1:30")
    result, joined = run_and_join(job, 2)
    assert joined is not None and joined["steps"] == 48
    assert joined["resumed_from"]["checkpoint"] == "a live peer" and 10 <= joined["resumed_from"]["step"] <= 30
    assert result["steps"] == 48 and result["fault_tolerance"]["restarts"] == [0, 0, 0]
    got = _params(result["run_dir"])
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6)
    assert joined["parameters_sha256"] == result["parameters_sha256"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":  # a child not yet reaped is no group
            out.append(int(stat.parent.name))
    return out


def run_killing_one_from_outside(doc: dict[str, Any], *, processes: int) -> dict[str, Any]:
    """``ft.run`` of the job ``doc`` with its last started process (of the ``processes`` the
    groups have in all) SIGKILLed once training logged: a real signal at no chosen point."""
    import multiprocessing.forkserver
    import threading

    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(ft.run(load_job(doc))))
    runner.start()
    _training_began(Path(doc["run"]["output_dir"]) / doc["run"]["name"])
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    started = _children(server)
    assert len(started) == processes
    os.kill(max(started), signal.SIGKILL)
    runner.join(180)
    return result


def test_group_sigkilled_mid_step_from_outside(tmp_path: Path) -> None:
    # a real SIGKILL at no chosen point (inside a step, an all-reduce or a quorum): the
    # survivor's step in flight is not committed and is taken again; the group restarts alone
    job = _job(tmp_path, "outside", ft_table={"min_replicas": 1}, max_restarts=1, log_every=10)
    doc = job.to_json_dict()
    doc["train"].update(max_steps=400, epochs=100)
    result = run_killing_one_from_outside(doc, processes=2)
    assert result["steps"] == 400
    assert sorted(result["fault_tolerance"]["restarts"]) == [0, 1]
    assert result["fault_tolerance"]["parameters_sha256_by_replica"] == [result["parameters_sha256"]] * 2


def assert_quorum_timeout(run: Any, timeout_s: float) -> None:
    """``run()`` fails with the quorum timeout's error, which fired when due (not later), and
    within 120 s start-up included (no hang)."""
    began = time.monotonic()
    with pytest.raises(WorkerError, match=f"quorum_timeout_s = {timeout_s:g} s") as err:
        run()
    waited = float(err.value.message.rsplit("waited ", 1)[1].split(" s")[0])
    assert timeout_s - 0.5 <= waited <= timeout_s + 2
    assert time.monotonic() - began < 120


def test_quorum_timeout_fails_in_bounded_time_then_resume_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain: dict[str, Any]) -> None:
    # min_replicas = 2 and group 1 dies after step 3 with no restart: group 0 can never form
    # a quorum again; group 0 checkpointed step 2
    monkeypatch.setenv(dp.FAULT_ENV, "1:3")
    table = {"min_replicas": 2, "quorum_timeout_s": 3}
    job = _job(tmp_path, "timeout", ft_table=table, max_restarts=0, checkpoint_every=2)
    assert_quorum_timeout(lambda: ft.run(job), 3)
    # --resume: every group reads group 0's checkpoint and the run ends as an uninterrupted one
    monkeypatch.delenv(dp.FAULT_ENV)
    resumed = ft.run(job, resume=True)
    assert resumed["resumed_from"]["checkpoint"] == "step-000000002"
    assert resumed["fault_tolerance"]["parameters_sha256_by_replica"] == [plain["parameters_sha256"]] * 2


@pytest.mark.parametrize(("table", "strategy", "field"), [
    ({}, {"type": "Local"}, "fault_tolerance"),
    ({}, {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "ParameterServer"}},
     "fault_tolerance"),
    ({"min_replicas": 3}, None, "fault_tolerance.min_replicas"),
    ({"min_replicas": 0}, None, "fault_tolerance.min_replicas"),
    ({"lighthouse": "nowhere"}, None, "fault_tolerance.lighthouse"),
    ({"listen": "start"}, None, "fault_tolerance.listen"),
    ({"quorum_timeout_s": 0}, None, "fault_tolerance.quorum_timeout_s"),
    ({"groups": 3}, None, "fault_tolerance.groups"),
])
def test_bad_fault_tolerance_names_the_field(tmp_path: Path, table: dict[str, Any],
                                             strategy: dict[str, Any] | None, field: str) -> None:
    doc = _job(tmp_path, "bad").to_json_dict()
    doc["fault_tolerance"] = table
    if strategy is not None:
        doc["strategy"] = strategy
    with pytest.raises(ConfigError) as err:
        load_job(doc)
    assert [p for p, _ in err.value.problems] == [field]


def test_another_lighthouse_keeps_its_own_timings(tmp_path: Path) -> None:
    job = _job(tmp_path, "external", ft_table={"lighthouse": "10.0.0.7:29510"})
    eff = effective_settings(job)
    assert eff.settings["fault_tolerance"]["lighthouse"] == "10.0.0.7:29510"
    assert {i.field for i in eff.ignored} >= {"fault_tolerance.join_timeout_s",
                                              "fault_tolerance.heartbeat_timeout_s"}


@pytest.mark.parametrize(("ft_table", "group", "field"), [
    (None, "1", "fault_tolerance"),  # no [fault_tolerance] table
    ({}, "2", "strategy.num_replicas"),  # groups 0 and 1 only
    ({}, "1", "run.name"),  # no run going: no Lighthouse address in the run folder
])
def test_join_group_command_errors_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   ft_table: dict[str, Any] | None, group: str, field: str) -> None:
    from paratrain.cli import main

    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job(tmp_path, "join", ft_table=ft_table).to_json_dict()))
    assert main(["run", str(path), "--join-group", group]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {field}: " in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag", [["--resume"], ["--overwrite"], ["--nnodes", "2"]])
def test_join_group_refuses_the_flags_of_a_run_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          flag: list[str]) -> None:
    from paratrain.cli import main

    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job(tmp_path, "join", ft_table={}).to_json_dict()))
    assert main(["run", str(path), "--join-group", "1", *flag]) == 2
    err = capsys.readouterr().err
    assert f"--join-group: cannot be used with {flag[0]}" in err and "Traceback" not in err, err
