"""A bad newest checkpoint on one rank of a multi-process job: every rank falls back to
the newest step that all ranks can read (:meth:`paratrain.training.stores.RankStore.load`),
rank 0 warns naming the file, and the resumed DataParallel run ends bit-identical to an
uninterrupted one; when one rank has no readable checkpoint, a ConfigError names the
files and nothing on disk changes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from _workers_federated import TOPK_EF, fed_job
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.executors.data_parallel import runner as data_parallel
from paratrain.executors.federated import run_in_process
from paratrain.files import step_folders
from paratrain.training.rundir import LOCK_NAME

pytestmark = pytest.mark.timeout(300)


def _doc(tmp: Path, name: str, steps: int) -> dict[str, Any]:
    return {
        "run": {"name": name, "seed": 5, "output_dir": str(tmp), "checkpoint_every": 5},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": steps,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
    }


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _snapshot(d: Path) -> dict[str, bytes]:
    """The run's state: checkpoints, metrics, summary, report (not the lock, nor job.json and
    worker-<rank>.log, which the launcher writes for every attempt before and after the workers)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME and p.name != "job.json" and not p.name.startswith("worker-")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return data_parallel.run(load_job(_doc(tmp_path_factory.mktemp("ref"), "ref", 15)))


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of a 10-step run named "a" (checkpoints at 5 and 10 on both ranks):
    one launch that each test below copies into its own output_dir before damaging it."""
    out = tmp_path_factory.mktemp("ten")
    data_parallel.run(load_job(_doc(out, "a", 10)))
    return out / "a"


def _rank_ckpts(tmp: Path, name: str, rank: int) -> list[Path]:
    """Rank ``rank``'s data file of each DCP step folder (``__<rank>_0.distcp``)."""
    return [f / f"__{rank}_0.distcp" for f in step_folders(tmp / name / "checkpoints")]


def test_bad_newest_checkpoint_on_one_rank_falls_back_on_every_rank(
    tmp_path: Path, reference: dict[str, Any], ten_steps: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(ten_steps, tmp_path / "a")
    ckpts = _rank_ckpts(tmp_path, "a", 1)
    assert [p.parent.name for p in ckpts] == ["step-000000005", "step-000000010"]
    assert all(p.is_file() for p in ckpts + _rank_ckpts(tmp_path, "a", 0))
    _truncate(ckpts[-1])
    capfd.readouterr()
    resumed = data_parallel.run(load_job(_doc(tmp_path, "a", 15)), resume=True)
    err = capfd.readouterr().err
    assert "RuntimeWarning" in err and str(ckpts[-1].parent) in err, err
    assert "truncated or corrupt" in err and "falling back to step 5" in err, err
    # Rank 0's step-10 file was fine, yet both ranks went back to step 5 and retrained.
    assert resumed["steps"] == 15
    assert resumed["parameters_sha256"] == reference["parameters_sha256"]


def test_no_readable_checkpoint_on_one_rank_is_an_error_naming_the_files(tmp_path: Path, ten_steps: Path) -> None:
    shutil.copytree(ten_steps, tmp_path / "b")
    ckpts = _rank_ckpts(tmp_path, "b", 1)
    assert len(ckpts) == 2
    for p in ckpts:
        _truncate(p)
    before = _snapshot(tmp_path / "b")
    assert "metrics.jsonl" in before and "summary.json" in before and len(before) >= 6
    with pytest.raises(ConfigError) as err:
        data_parallel.run(load_job(_doc(tmp_path, "b", 15)), resume=True)
    msg = dict(err.value.problems)["checkpoint"]
    assert "no readable checkpoint" in msg and all(str(p.parent) in msg for p in ckpts), msg
    assert _snapshot(tmp_path / "b") == before


def test_federated_bad_newest_checkpoint_moves_the_server_and_clients_back(tmp_path: Path) -> None:
    """The server and the clients' state (error-feedback residuals) of a round are one DCP
    folder: a damaged data file of round 2 takes the whole run back to round 1."""
    kw: dict[str, Any] = dict(K=4, sel={"method": "All"}, compression=TOPK_EF, local_epochs=1)
    ref = run_in_process(fed_job(tmp_path / "ref", "f", rounds=3, **kw))
    run_in_process(fed_job(tmp_path / "b", "f", rounds=2, **kw))
    ckpts = _rank_ckpts(tmp_path / "b", "f", 0)
    assert [p.parent.name for p in ckpts] == ["step-000000001", "step-000000002"]
    assert all(p.is_file() for p in ckpts)
    _truncate(ckpts[-1])  # round 2's server state and residuals are lost: back to round 1
    with pytest.warns(RuntimeWarning, match=r"step-000000002 is not readable.*falling back to step 1"):
        resumed = run_in_process(fed_job(tmp_path / "b", "f", rounds=3, **kw), resume=True)
    assert resumed["parameters_sha256"] == ref["parameters_sha256"]
