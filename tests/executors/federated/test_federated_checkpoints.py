"""Federated checkpoints (the run's lifecycle, executors/federated/state.py):
``run.checkpoint_every`` counts rounds, and SIGINT stops a 2-worker run at the end of the
round in progress after a checkpoint of that round (server and every worker in one
``step-<r>`` folder), exit 130; ``--resume`` ends with the uninterrupted run's parameters."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from _interrupting import start_cli, wait_until
from _workers_federated import TOPK_EF, fed_job
from paratrain.config import load_job
from paratrain.dispatch import execute
from paratrain.files import step_folders
from paratrain.training import read_metrics
from paratrain.training.stores import read_rank_state

pytestmark = pytest.mark.timeout(400)


def _doc(out: Path, *, rounds: int, every: int | str, workers: int) -> dict[str, Any]:
    doc = fed_job(out, "fed", K=4, rounds=rounds, num_workers=workers, local_epochs=1, batch_size=16,
                  hidden=32, compression=TOPK_EF).to_json_dict()
    doc["run"]["checkpoint_every"] = every
    return doc


def _rounds(d: Path) -> list[int]:
    return [int(p.name[5:]) for p in step_folders(d)]


def test_checkpoint_every_counts_rounds(tmp_path: Path) -> None:
    out = execute(load_job(_doc(tmp_path, rounds=7, every=3, workers=1)))
    ckpts = Path(out["run_dir"]) / "checkpoints"
    # rounds 3 and 6, then the end (7); the store keeps the two newest
    assert _rounds(ckpts) == [6, 7]
    state = read_rank_state(ckpts / "step-000000007")
    assert state["engine"]["server"]["round"] == 7 and state["step"] == 7
    assert set(state["engine"]["clients"]["codec"]) == {f"client-{c}" for c in range(4)}  # TopK residuals


@pytest.mark.parametrize(("every", "kept"), [("1h", [5]), ("0.001s", [4, 5])])
def test_checkpoint_every_as_a_wall_time_is_checked_between_rounds(
        tmp_path: Path, every: str, kept: list[int]) -> None:
    """An hour never comes due in 5 rounds (only the end is saved); a millisecond is due
    after every round."""
    out = execute(load_job(_doc(tmp_path, rounds=5, every=every, workers=1)))
    assert _rounds(Path(out["run_dir"]) / "checkpoints") == kept


@pytest.mark.slow
def test_sigint_checkpoints_the_round_in_progress_and_resume_is_bit_identical(tmp_path: Path) -> None:
    doc = _doc(tmp_path / "int", rounds=30, every="1h", workers=2)  # no checkpoint but the signal's
    job = tmp_path / "job.json"
    job.write_text(json.dumps(doc))
    run_dir = tmp_path / "int" / "fed"
    proc = start_cli(job)
    wait_until(lambda: (run_dir / "metrics.jsonl").exists() and bool(read_metrics(run_dir)), proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    ckpts = run_dir / "checkpoints"
    saved = _rounds(ckpts)
    assert len(saved) == 1 and 1 <= saved[0] < 30, saved  # the round of the signal, not each round
    assert {c for r in (0, 1) for c in read_rank_state(ckpts / f"step-{saved[0]:09d}", r)["engine"]["clients"]["codec"]} \
        == {f"client-{c}" for c in range(4)}  # every worker's clients
    assert max(int(r["round"]) for r in read_metrics(run_dir)) == saved[0]

    resumed = execute(load_job(doc), resume=True)
    assert resumed["client_updates_this_run"] == 4 * (30 - saved[0])
    ref = execute(load_job(_doc(tmp_path / "ref", rounds=30, every="1h", workers=2)))
    assert resumed["parameters_sha256"] == ref["parameters_sha256"]


def test_stateless_clients_process_0_saves_alone_and_resume_is_exact(tmp_path: Path) -> None:
    """FedAvg with stateless clients on 2 workers: the checkpoint is the server's, written by
    process 0 without a collective (layout world 1, one data file); resumed it ends where the
    straight run does."""
    def doc(out: Path, rounds: int) -> dict[str, Any]:
        return fed_job(out, "fed", K=4, rounds=rounds, num_workers=2, local_epochs=1, batch_size=16,
                       hidden=32).to_json_dict()

    straight = execute(load_job(doc(tmp_path / "a", 4)))
    cut = execute(load_job(doc(tmp_path / "b", 2)))
    newest = step_folders(Path(cut["run_dir"]) / "checkpoints")[-1]
    assert json.loads((newest / "layout.json").read_text())["world"] == 1
    assert sorted(p.name for p in newest.glob("*.distcp")) == ["__0_0.distcp"]
    more = execute(load_job(doc(tmp_path / "b", 4)), resume=True)
    assert more["client_updates_this_run"] == 2 * 4
    assert more["parameters_sha256"] == straight["parameters_sha256"]
