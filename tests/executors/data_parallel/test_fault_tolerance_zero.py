"""DataParallel under ``[fault_tolerance]`` with replica groups of several processes that shard
by ZeRO among themselves and replicate each other (torchft's HSDP layout), in torchft's own
style: 2 groups of 2 processes on gloo, a real Lighthouse on 127.0.0.1, a process SIGKILLed at
a chosen step (``PARATRAIN_FAULT_KILL``, first attempt only):

* every group alive: the parameters equal plain DataParallel's with the same ``num_replicas``
  and ``shard`` (rtol 1e-5: a group's mean, then the quorum's, sums in another order than one
  mean over 4), and a process holds half the optimizer state (its rows);
* process 1 of group 1 killed after step 9: only group 1 restarts (both its processes), each
  heals from the same process of group 0 at step 9 (past group 0's step-8 checkpoint on disk),
  and with ``min_replicas = 2`` no step is committed without it, so every group ends with the
  uninterrupted run's parameters;
* a process SIGKILLed from outside at no chosen point: its group restarts alone and heals;
* a group of processes joins a running job (``groups = 1``, ``join_group``) and heals;
* the group settings are ConfigErrors naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fault_tolerance import (
    assert_quorum_timeout,
    run_and_join,
    run_killing_one_from_outside,
)

from paratrain.config import ConfigError, load_job
from paratrain.executors.data_parallel import fault_tolerance as ft
from paratrain.executors.data_parallel import runner as dp

pytestmark = [pytest.mark.timeout(300)]

WHOLE = (64 * 32 + 32 + 32 * 10 + 10) * 4  # bytes of the MLP's parameters (one momentum buffer each)


def _job(tmp: Path, name: str, *, shard: str, ft_table: dict[str, Any] | None = None, **run: Any) -> Any:
    doc: dict[str, Any] = {
        "run": {"name": name, "output_dir": str(tmp), "seed": 3, "progress_every": "off", **run},
        "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits"},
        "train": {"epochs": 2, "batch_size": 16, "max_steps": 24, "eval_every": 0,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "strategy": {"type": "DataParallel", "num_replicas": 4, "aggregation": {"method": "AllReduce"},
                     "shard": shard},
    }
    if ft_table is not None:
        doc["fault_tolerance"] = {"quorum_timeout_s": 60, "join_timeout_s": 0.5, "heartbeat_timeout_s": 2.0,
                                  "processes_per_group": 2, **ft_table}
    return load_job(doc)


def _params(run_dir: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def _assert_same_model(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Plain DataParallel's parameters at each ZeRO level, 4 replicas (no [fault_tolerance])."""
    out: dict[str, dict[str, Any]] = {}

    def get(shard: str) -> dict[str, Any]:
        if shard not in out:
            with pytest.MonkeyPatch.context() as mp:  # a test's injected kill is not the reference's
                mp.delenv(dp.FAULT_ENV, raising=False)
                out[shard] = _params(dp.run(_job(tmp_path_factory.mktemp("plain"), "plain", shard=shard))["run_dir"])
        return out[shard]
    return get  # type: ignore[return-value]


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_every_group_alive_equals_plain_zero(tmp_path: Path, plain: Any, shard: str) -> None:
    summary = ft.run(_job(tmp_path, "ft", shard=shard, ft_table={}))
    assert summary["steps"] == 24 and summary["processes_per_group"] == 2 and summary["shard"] == shard
    assert summary["fault_tolerance"]["restarts"] == [0, 0]
    assert summary["fault_tolerance"]["parameters_sha256_by_replica"] == [summary["parameters_sha256"]] * 2
    _assert_same_model(_params(summary["run_dir"]), plain(shard))
    # each process of a group steps its own rows: half the momentum buffers (64/2, 32/2, 10/2 rows)
    assert summary["held_bytes"]["optimizer"] == WHOLE // 2


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_killed_process_restarts_its_group_alone_and_heals_from_the_same_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain: Any, shard: str) -> None:
    # process 1 of group 1 (data shard 3) dies after step 9; group 0 checkpoints every 4 steps
    # (its step-8 checkpoint is what group 1 reads from disk); min_replicas = 2: group 0 waits
    # at step 10's quorum for group 1, so no step is committed without it
    monkeypatch.setenv(dp.FAULT_ENV, "3:9")
    job = _job(tmp_path, "kill", shard=shard, ft_table={"min_replicas": 2}, max_restarts=1,
               checkpoint_every=4)
    summary = ft.run(job)
    run_dir = Path(summary["run_dir"])
    assert summary["steps"] == 24 and summary["restart_count"] == 0
    assert summary["fault_tolerance"]["restarts"] == [0, 1]  # group 0 was not restarted
    assert summary["fault_tolerance"]["parameters_sha256_by_replica"] == [summary["parameters_sha256"]] * 2
    healed = json.loads((run_dir / "replica-1.json").read_text())
    assert healed["restart_count"] == 1 and healed["steps"] == 24
    assert healed["resumed_from"]["checkpoint"] == "a live peer" and healed["resumed_from"]["step"] == 9
    survivor = json.loads((run_dir / "replica-0.json").read_text())
    assert survivor["restart_count"] == 0 and survivor["resumed_from"] is None
    assert survivor["steps_short_of_groups"] == 0
    # group 0's checkpoints hold each process's rows (2 processes), resumable on any layout
    layout = json.loads((run_dir / "checkpoints" / "step-000000024" / "layout.json").read_text())
    assert (layout["world"], layout["replicas"], layout["shard"]) == (2, 4, shard)
    # both processes of group 1 healed their shard state (rows, momentum) from group 0's
    _assert_same_model(_params(run_dir), plain(shard))


def test_process_sigkilled_mid_step_from_outside(tmp_path: Path) -> None:
    # a real SIGKILL of process 1 of group 1 (the last started) at no chosen point, inside a
    # step's reduce-scatter, all-reduce or quorum: its group-mate is killed with it, group 0's
    # step in flight is not committed and taken again, and group 1 restarts alone and heals
    doc = _job(tmp_path, "outside", shard="parameters", ft_table={"min_replicas": 1}, max_restarts=1,
               log_every=10).to_json_dict()
    # the kill lands after step 10 and group 1 was back by step ~10 (its restart is within the
    # quorum's heartbeat timeout); 140 steps more leave room for a slow restart under load
    doc["train"].update(max_steps=150, epochs=100)
    result = run_killing_one_from_outside(doc, processes=4)
    assert result["steps"] == 150 and sorted(result["fault_tolerance"]["restarts"]) == [0, 1]
    assert result["fault_tolerance"]["parameters_sha256_by_replica"] == [result["parameters_sha256"]] * 2


def test_a_group_of_processes_joins_the_running_job(tmp_path: Path) -> None:
    # groups = 1: paratrain run starts group 0 alone; group 1 (both its processes) joins once
    # training logged, each process healing its rows from the same process of group 0
    doc = _job(tmp_path, "elastic", shard="gradients", ft_table={"groups": 1}, log_every=10).to_json_dict()
    doc["train"].update(max_steps=120, epochs=100)  # group 1 joined near step 20
    result, joined = run_and_join(load_job(doc), 1)
    assert joined is not None and joined["steps"] == 120
    assert joined["resumed_from"]["checkpoint"] == "a live peer" and 10 <= joined["resumed_from"]["step"] < 120
    assert result["steps"] == 120 and joined["parameters_sha256"] == result["parameters_sha256"]


@pytest.mark.parametrize(("strategy", "table", "field"), [
    ({"num_replicas": 4}, {"processes_per_group": 3}, "fault_tolerance.processes_per_group"),
    ({"shard": "none"}, {}, "fault_tolerance.processes_per_group"),
    ({}, {"processes_per_group": 1}, "fault_tolerance.processes_per_group"),
    ({}, {"replay": True}, "fault_tolerance.replay"),
    ({}, {"min_replicas": 3}, "fault_tolerance.min_replicas"),
    ({}, {"groups": 3}, "fault_tolerance.groups"),
    ({}, {"processes_per_group": 0}, "fault_tolerance.processes_per_group"),
])
def test_bad_groups_name_the_field(tmp_path: Path, strategy: dict[str, Any], table: dict[str, Any],
                                   field: str) -> None:
    doc = _job(tmp_path, "bad", shard="optimizer", ft_table={}).to_json_dict()
    doc["strategy"].update(strategy)
    doc["fault_tolerance"].update(table)
    with pytest.raises(ConfigError) as err:
        load_job(doc)
    assert [p for p, _ in err.value.problems] == [field]


def test_join_group_counts_groups_not_processes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:  # 4 processes in 2 groups: no group 2
        ft.join_group(_job(tmp_path, "join", shard="optimizer", ft_table={}), 2)
    assert err.value.problems[0][0] == "strategy.num_replicas" and "2 groups" in err.value.problems[0][1]


def test_quorum_timeout_of_a_group_of_processes_then_resume_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain: Any) -> None:
    # process 0 of group 1 dies after step 3, no restart: its group goes down whole, and with
    # min_replicas = 2 group 0's two processes wait for a quorum that never forms; group 0's
    # processes checkpointed their rows at step 2
    monkeypatch.setenv(dp.FAULT_ENV, "2:3")
    job = _job(tmp_path, "timeout", shard="optimizer", ft_table={"min_replicas": 2, "quorum_timeout_s": 3},
               max_restarts=0, checkpoint_every=2)
    assert_quorum_timeout(lambda: ft.run(job), 3)
    # --resume: each process of every group reads its rows of group 0's checkpoint, and the run
    # ends with the uninterrupted run's parameters
    monkeypatch.delenv(dp.FAULT_ENV)
    resumed = ft.run(job, resume=True)
    assert resumed["resumed_from"]["checkpoint"] == "step-000000002"
    assert resumed["fault_tolerance"]["parameters_sha256_by_replica"] == [resumed["parameters_sha256"]] * 2
    _assert_same_model(_params(resumed["run_dir"]), plain("optimizer"))
