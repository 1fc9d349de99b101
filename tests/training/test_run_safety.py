"""Safe by default: run names cannot escape ``output_dir``, a finished run is never
deleted implicitly, a run folder is locked while a run uses it, a bad newest checkpoint
falls back to an older one, a mismatched resume names what differs and changes nothing,
and an unwritable ``output_dir`` is a ConfigError naming the path."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from paratrain import cli
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.dispatch import execute
from paratrain.executors.data_parallel import runner as data_parallel
from paratrain.files import step_folders
from paratrain.training import read_metrics
from paratrain.training.rundir import LOCK_NAME, holds_run, run_dir_of, safe_rmtree
from paratrain.training.stores import LocalStore

pytestmark = pytest.mark.timeout(300)


def _doc(tmp: Path, name: str = "a", *, steps: int = 20, hidden: int = 32, **run: Any) -> dict[str, Any]:
    return {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp), "checkpoint_every": 5, **run},
        "model": {"name": "mlp", "hidden": [hidden]},
        "train": {"epochs": 1, "batch_size": 32, "max_steps": steps,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
    }


def _snapshot(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (but the lock, which holds the last holder's pid) -> bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def _problems(err: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return dict(err.value.problems)


# 1. run names -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "../../x", "/abs", "/tmp/abs", "a/b", "..", ".", "", "a\\b"])
def test_run_name_must_be_one_folder_inside_output_dir(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_job(_doc(tmp_path, name))
    assert "run.name" in _problems(err), err.value
    assert repr(name) in _problems(err)["run.name"]


def test_run_dir_of_rejects_a_name_that_bypassed_validation(tmp_path: Path) -> None:
    job = load_job(_doc(tmp_path / "runs"))
    sneaky = job.model_copy(update={"run": job.run.model_copy(update={"name": "../victim"})})
    with pytest.raises(ConfigError, match="run.name"):
        run_dir_of(sneaky)


def test_safe_rmtree_deletes_only_inside_its_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "victim"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    for target in (outside, root / ".." / "victim", root, root / "."):
        with pytest.raises(RuntimeError, match="refusing to delete"):
            safe_rmtree(target, root)
    assert (outside / "keep.txt").read_text() == "precious" and root.is_dir()
    (root / "link").symlink_to(outside)  # a symlink inside root: the link goes, not its target
    safe_rmtree(root / "link", root)
    safe_rmtree(root / "a", root)
    assert not (root / "link").exists() and not (root / "a").exists()
    assert (outside / "keep.txt").read_text() == "precious"


# 2. a finished run survives -----------------------------------------------------------


def test_finished_run_survives_a_failing_and_a_plain_fresh_run(tmp_path: Path) -> None:
    first = paratrain.fit(_doc(tmp_path, steps=10))
    run_dir = tmp_path / "a"
    before = _snapshot(run_dir)
    assert "summary.json" in before and holds_run(run_dir)

    # A fresh run without --overwrite is refused, naming both ways out.
    with pytest.raises(ConfigError) as err:
        paratrain.fit(_doc(tmp_path, steps=10))
    msg = _problems(err)["run.name"]
    assert str(run_dir) in msg and "--overwrite" in msg and "--resume" in msg
    assert _snapshot(run_dir) == before

    # Even with overwrite, a job whose model cannot be built changes nothing on disk.
    bad = _doc(tmp_path, steps=10)
    bad["model"] = {"name": "mlp", "hidden": [32], "no_such_kwarg": 1}
    with pytest.raises(ConfigError):
        paratrain.fit(bad, overwrite=True)
    bad = _doc(tmp_path, steps=10)
    bad["model"] = {"name": "no-such-model"}
    with pytest.raises(ConfigError):
        paratrain.fit(bad, overwrite=True)
    assert _snapshot(run_dir) == before

    # overwrite=True replaces it: 7 steps now, one evaluation record, a fresh summary.
    second = paratrain.fit(_doc(tmp_path, steps=7), overwrite=True)
    assert second["steps"] == 7 and first["steps"] == 10
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 7
    assert [r["step"] for r in read_metrics(run_dir)] == [7]
    assert [p.name for p in step_folders(run_dir / "checkpoints")] == ["step-000000005", "step-000000007"]


def test_cli_refuses_then_overwrite_replaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_doc(tmp_path / "runs", steps=4)))
    assert cli.main(["run", "-q", str(job)]) == 0
    before = _snapshot(tmp_path / "runs" / "a")
    capsys.readouterr()
    assert cli.main(["run", "-q", str(job)]) == 2
    err = capsys.readouterr().err
    assert "run.name" in err and "--overwrite" in err and "Traceback" not in err
    assert _snapshot(tmp_path / "runs" / "a") == before
    assert cli.main(["run", "-q", "--overwrite", str(job)]) == 0
    with pytest.raises(SystemExit) as exit_info:  # contradictory flags: argparse usage error
        cli.main(["run", "-q", "--overwrite", "--resume", str(job)])
    assert exit_info.value.code == 2


def test_a_folder_without_results_is_not_a_finished_run(tmp_path: Path) -> None:
    """A run that failed before producing anything (job.json, empty folders, the lock)
    does not block a fresh run."""
    d = tmp_path / "a"
    (d / "checkpoints").mkdir(parents=True)
    (d / "job.json").write_text("{}")
    (d / LOCK_NAME).write_text("1\n")
    (d / "worker-1.log").write_text("Traceback ...\n")  # a failed attempt's diagnostics
    assert not holds_run(d)
    (d / "checkpoints" / "ckpt-000000001.pt").write_bytes(b"x")
    assert holds_run(d)  # non-vacuity: a checkpoint is a result
    (d / "checkpoints" / "ckpt-000000001.pt").unlink()
    assert paratrain.fit(_doc(tmp_path, steps=2))["steps"] == 2


def test_data_parallel_refuses_and_overwrites(tmp_path: Path) -> None:
    paratrain.fit(_doc(tmp_path, "dp", steps=3))  # a finished (Local) run in the folder
    before = _snapshot(tmp_path / "dp")
    doc = _doc(tmp_path, "dp", steps=3)
    doc["strategy"] = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    doc["run"]["checkpoint_every"] = 0
    job = load_job(doc)
    with pytest.raises(ConfigError, match="--overwrite"):
        execute(job)  # refused before any worker is spawned
    assert _snapshot(tmp_path / "dp") == before
    # The launching process holds the lock while its spawned workers write into the
    # folder (they must not wait for it).
    again = execute(job, overwrite=True)
    assert again["steps"] == 3 and again["num_replicas"] == 2
    assert json.loads((tmp_path / "dp" / "job.json").read_text())["strategy"]["type"] == "DataParallel"
    kinds = [json.loads((f / "layout.json").read_text())["kind"]
             for f in step_folders(tmp_path / "dp" / "checkpoints")]
    assert kinds and set(kinds) == {"dp"}  # Local's are gone


# 3. one run per folder at a time ------------------------------------------------------


_HOLDER = """
import sys
from paratrain.config.job import load_job
from paratrain.training.rundir import RunFolder
folder = RunFolder(load_job({"run": {"name": "a", "output_dir": sys.argv[1]}}))
folder.__enter__()
print("held", flush=True)
sys.stdin.read()
"""


def _hold(out: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_of_the_same_folder_fails_naming_the_holder(tmp_path: Path) -> None:
    holder = _hold(tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            paratrain.fit(_doc(tmp_path, steps=2))
        assert f"pid {holder.pid}" in _problems(err)["run.name"]
        dp = _doc(tmp_path, steps=2)
        dp["strategy"] = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            data_parallel.run(load_job(dp))  # fails before any worker is spawned
        assert not (tmp_path / "a" / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock with the process
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert paratrain.fit(_doc(tmp_path, steps=2))["steps"] == 2


# 4. checkpoints -----------------------------------------------------------------------


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(bytes(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0),
                                             dtype=torch.uint8).tolist()))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return paratrain.fit(_doc(tmp_path_factory.mktemp("ref"), "ref", steps=20))


@pytest.mark.parametrize("how", ["empty", "truncated", "garbage"])
def test_bad_newest_checkpoint_falls_back_to_the_older_one(
    tmp_path: Path, how: str, reference: dict[str, Any]
) -> None:
    paratrain.fit(_doc(tmp_path, steps=20))
    folders = step_folders(tmp_path / "a" / "checkpoints")
    assert [p.name for p in folders] == ["step-000000015", "step-000000020"]
    _corrupt(folders[-1] / ".metadata", how)  # DCP's index of the checkpoint
    with pytest.warns(RuntimeWarning, match="step-000000020 is not readable.*falling back to step 15"):
        resumed = paratrain.fit(_doc(tmp_path, steps=20), resume=True)
    # Resumed from step 15 and trained 5 steps again: the uninterrupted run's parameters.
    assert resumed["steps"] == 20
    assert resumed["parameters_sha256"] == reference["parameters_sha256"]


def test_no_readable_checkpoint_is_an_error_naming_the_files(tmp_path: Path) -> None:
    paratrain.fit(_doc(tmp_path, steps=20))
    ckpts = step_folders(tmp_path / "a" / "checkpoints")
    _corrupt(ckpts[0] / ".metadata", "garbage")
    _corrupt(ckpts[1] / "__0_0.distcp", "truncated")
    before = _snapshot(tmp_path / "a")
    with pytest.warns(RuntimeWarning), pytest.raises(ConfigError) as err:
        paratrain.fit(_doc(tmp_path, steps=20), resume=True)
    msg = _problems(err)["checkpoint"]
    assert all(str(p) in msg for p in ckpts)
    assert _snapshot(tmp_path / "a") == before


def test_resume_with_another_model_or_optimizer_names_it_and_changes_nothing(tmp_path: Path) -> None:
    paratrain.fit(_doc(tmp_path, steps=10))
    before = _snapshot(tmp_path / "a")
    with pytest.raises(ConfigError) as err:
        paratrain.fit(_doc(tmp_path, steps=20, hidden=16), resume=True)
    msg = _problems(err)["model"]
    assert "fc0.weight: checkpoint (32, 64), model (16, 64)" in msg and "step-000000010" in msg
    assert _snapshot(tmp_path / "a") == before

    adam = _doc(tmp_path, steps=20)
    adam["train"]["optimizer"] = {"name": "adam", "lr": 1e-3}
    with pytest.raises(ConfigError) as err:
        paratrain.fit(adam, resume=True)
    assert "SGD" in _problems(err)["train.optimizer"] and "Adam" in _problems(err)["train.optimizer"]
    assert _snapshot(tmp_path / "a") == before

    # (Local, DataParallel and ModelParallel resume each other's checkpoints by name)
    fed = _doc(tmp_path, steps=20)
    fed["strategy"] = {"type": "Federated", "num_clients": 2, "rounds": 2,
                       "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}}
    with pytest.raises(ConfigError) as err:
        execute(load_job(fed), resume=True)
    assert "Local" in _problems(err)["strategy.type"] and "Federated" in _problems(err)["strategy.type"]
    assert _snapshot(tmp_path / "a") == before


def test_unwritable_output_dir_names_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() == 0:  # root ignores permission bits: a file where a folder must be
        (tmp_path / "afile").write_text("not a folder")
        out = tmp_path / "afile" / "runs"
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o500)
        out = tmp_path / "ro" / "runs"
    try:
        with pytest.raises(ConfigError) as err:
            paratrain.fit(_doc(out, steps=2))
        assert str(out) in _problems(err)["run.output_dir"]
        job = tmp_path / "job.json"
        job.write_text(json.dumps(_doc(out, steps=2)))
        capsys.readouterr()
        assert cli.main(["run", "-q", str(job)]) == 2
        err_text = capsys.readouterr().err
        assert "run.output_dir" in err_text and str(out) in err_text and "Traceback" not in err_text
    finally:
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o700)


def test_full_disk_while_checkpointing_names_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails (ENOSPC from the file system under DCP's writer) is a ConfigError
    naming the checkpoint folder and the reason; no partial folder is left as complete."""
    import torch.distributed.checkpoint.filesystem as fs

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs, "_write_item", no_space)
    store = LocalStore(tmp_path / "checkpoints")
    w = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    state = {"model": w.state_dict(), "optimizer": opt.state_dict(), "param_names": ["weight", "bias"],
             "step": 7, "epoch": 0, "batch": 0, "rng": None, "losses": [], "layout": {}}
    with pytest.raises(ConfigError) as err:
        store.save(7, state)
    msg = _problems(err)["run.output_dir"]
    assert "step-000000007" in msg and os.strerror(errno.ENOSPC) in msg, msg
    assert step_folders(tmp_path / "checkpoints") == []  # nothing that looks complete
