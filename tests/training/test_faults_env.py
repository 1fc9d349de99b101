"""Fault injection lives outside the job schema (PARATRAIN_FAULTS), and bad values name the key."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.training import faults
from paratrain.training.faults import (
    FAULT_ENV,
    FAULTS_ENV,
    HOLD_RESTART_ENV,
    Faults,
    inject_faults,
    injected_faults,
    kill_points,
    maybe_hold_restart,
    maybe_kill,
    parse_faults,
)


def test_job_schema_has_no_fault_knobs() -> None:
    for section, key in [("federated", "fail_clients"), ("federated", "byzantine_clients"),
                         ("federated", "corrupt_clients"), ("population", "fail_members")]:
        with pytest.raises(ConfigError, match=f"{section}.{key}"):
            load_job({section: {key: [0]}})


def test_inject_faults_sets_and_restores_the_environment() -> None:
    assert FAULTS_ENV not in os.environ
    with inject_faults(fail_clients=[1], byzantine_clients=[2], byzantine_scale=-3):
        f = injected_faults()
        assert f.fail_clients == {1} and f.byzantine_clients == {2} and f.byzantine_scale == -3.0
    assert FAULTS_ENV not in os.environ and injected_faults() == Faults()


@pytest.mark.parametrize(("text", "field"), [
    ("[1]", "PARATRAIN_FAULTS"), ("{", "PARATRAIN_FAULTS"), ('{"fail_client": [1]}', "fail_client"),
    ('{"fail_clients": [-1]}', "fail_clients"), ('{"fail_clients": [true]}', "fail_clients"),
    ('{"byzantine_scale": "x"}', "byzantine_scale"),
])
def test_bad_values_name_the_key(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_faults(text)
    assert any(field in p for p, _ in e.value.problems)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_parse_never_raises_anything_but_config_error(text: str) -> None:
    try:
        parse_faults(text)
    except ConfigError:
        pass


def test_fault_kill_names_several_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # PARATRAIN_FAULT_KILL=RANK:STEP,RANK:STEP: each named process dies after its own step,
    # on its first attempt only (os.kill recorded instead of sent)
    assert kill_points("1:4") == {(1, 4)} and kill_points("0:5, 2:11") == {(0, 5), (2, 11)}
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setenv(FAULT_ENV, "0:5,2:11")
    calls = [(0, 5, 0), (0, 11, 0), (2, 5, 0), (2, 11, 0), (1, 5, 0), (2, 11, 1)]  # (rank, step, restarts)
    died = []
    for rank, step, restarts in calls:
        before = len(killed)
        maybe_kill(rank=rank, step=step, restart_count=restarts)
        if len(killed) > before:
            died.append((rank, step, restarts))
    assert died == [(0, 5, 0), (2, 11, 0)]
    assert {sig for _, sig in killed} == {faults.signal.SIGKILL}


def test_hold_restart_waits_for_the_named_file_on_a_restart_only(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # PARATRAIN_FAULT_HOLD_RESTART=NAME: a restarted process waits for NAME in its run folder
    # (a first attempt never waits; no file in time: TimeoutError naming it)
    monkeypatch.setenv(HOLD_RESTART_ENV, "replica-1.json")
    maybe_hold_restart(tmp_path, restart_count=0, timeout_s=0.01)  # no wait, no error
    with pytest.raises(TimeoutError, match="replica-1.json"):
        maybe_hold_restart(tmp_path, restart_count=1, timeout_s=0.2)
    writer = threading.Timer(0.5, (tmp_path / "replica-1.json").touch)
    began = time.monotonic()
    writer.start()
    maybe_hold_restart(tmp_path, restart_count=1, timeout_s=30)
    assert time.monotonic() - began >= 0.45 and (tmp_path / "replica-1.json").exists()
    monkeypatch.delenv(HOLD_RESTART_ENV)
    (tmp_path / "replica-1.json").unlink()
    maybe_hold_restart(tmp_path, restart_count=1, timeout_s=0.01)  # unset: no wait
