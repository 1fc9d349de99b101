"""training/checkpoint.py and stores.py: a process SIGKILLed in the middle of a checkpoint
save leaves a checkpoint-sized temp file (a temp folder for the one loop's DCP checkpoints); the next resume (or save, or prune) in that folder removes
it, touches nothing else, and the resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

import paratrain
from paratrain.files import step_folders
from paratrain.training.faults import KILL_IN_SAVE_ENV

pytestmark = pytest.mark.timeout(300)


def _doc(tmp: Path, name: str) -> dict[str, Any]:
    return {
        # log_every past the run: no training-curve records, test_rundir counts the lines of
        # metrics.jsonl's evaluation records
        "run": {"name": name, "seed": 5, "output_dir": str(tmp), "checkpoint_every": 5, "log_every": 100},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"epochs": 1, "batch_size": 32, "max_steps": 20, "eval_every": 5,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
    }


def _fit_in_child(parent: Any, doc: dict[str, Any]) -> None:
    parent.apply()  # this test's environment (with the fault), working directory and sys.path
    paratrain.fit(doc)


def killed_run(tmp: Path, name: str, in_save: str) -> Path:
    """A real Local run (``_doc``) SIGKILLed while saving checkpoint file ``in_save``; its folder.
    The run is a child of the session's warm forkserver (what ``paratrain run`` does in its own
    process, without a fresh interpreter importing torch: ~3 CPU-s)."""
    from paratrain.comm.forkserver import ParentState, context

    parent = ParentState(environ={**os.environ, KILL_IN_SAVE_ENV: in_save}, stdio=(None, None))
    proc = context().Process(target=_fit_in_child, args=(parent, _doc(tmp, name)))
    proc.start()
    proc.join(240)
    assert proc.exitcode == -signal.SIGKILL  # a real SIGKILL, in the middle of writing that file
    return tmp / name


def _temps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith((".ckpt-", ".step-")))


def test_sigkill_during_a_save_leaves_no_temp_file_after_resume(tmp_path: Path) -> None:
    """The one loop's checkpoints are torch.distributed.checkpoint folders written under a
    temp name and renamed when complete: a kill mid-save leaves the temp folder, which the
    resumed run removes."""
    full = paratrain.fit(_doc(tmp_path, "full"))

    ckpts = killed_run(tmp_path, "killed", "step-000000010") / "checkpoints"
    temps = _temps(ckpts)
    assert temps == [".step-000000010.tmp"], temps
    assert sum(p.stat().st_size for p in (ckpts / temps[0]).iterdir()) > 1000  # a whole checkpoint's bytes
    assert [p.name for p in step_folders(ckpts)] == ["step-000000005"]
    # Files that only look alike, and a temp name outside the checkpoint folder, are not ours.
    keep = [ckpts / "step-000000010.partial", ckpts / ".notes.txt.abcdefgh",
            tmp_path / "killed" / ".step-000000010.tmp"]
    for p in keep:
        p.write_text("user data")

    resumed = paratrain.fit(_doc(tmp_path, "killed"), resume=True)

    assert _temps(ckpts) == []
    assert all(p.read_text() == "user data" for p in keep)
    assert resumed["steps"] == full["steps"] == 20
    assert resumed["parameters_sha256"] == full["parameters_sha256"]


@pytest.mark.slow
def test_data_parallel_killed_mid_save_restarts_without_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both replicas of a 2-process DataParallel job are SIGKILLed while writing step 4's
    checkpoint (each in its own rank folder); the elastic restart resumes both from step 2,
    removes both temp files and ends bit-identical to an uninterrupted run."""
    from _workers_dp import dp_job
    from paratrain.dispatch import execute

    agg = {"method": "AllReduce"}
    extra = {"run": {"name": "x", "seed": 3, "output_dir": "", "checkpoint_every": 2,
                     "max_restarts": 1}}

    def job(name: str) -> Any:
        extra["run"] = {**extra["run"], "name": name, "output_dir": str(tmp_path)}
        return dp_job(str(tmp_path), name, 2, agg, **extra)

    clean = execute(job("clean"))
    monkeypatch.setenv(KILL_IN_SAVE_ENV, "step-000000004")
    killed = execute(job("killed"))
    assert killed["restart_count"] == 1  # the kill in the save really happened
    assert killed["parameters_sha256"] == clean["parameters_sha256"]
    ckpts = tmp_path / "killed" / "checkpoints"
    assert [p.name for p in step_folders(ckpts)] == ["step-000000002", "step-000000004"]
    assert [p for p in ckpts.rglob(".step-*")] == []
