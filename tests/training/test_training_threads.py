"""paratrain.training.threads: every training process picks its intra-op thread count
deliberately: its share of the available cores unless ``run.num_threads`` (or
``OMP_NUM_THREADS``) says otherwise, in the Local run (the caller's count put back after)
and in each launched worker (``LOCAL_WORLD_SIZE`` of them sharing the host's cores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.config import load_job
from paratrain.dispatch import execute
from paratrain.training.threads import available_cores, intra_op_threads

SEEN: list[int] = []


def probe_model(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A model factory that records the thread count it was built under (the last build is
    the executor's, inside the run)."""
    SEEN.append(torch.get_num_threads())
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


def report_threads(ctx: Any, job: Any, resume: bool) -> int:
    return torch.get_num_threads()


def _doc(tmp_path: Path, **run: Any) -> dict[str, Any]:
    return {"run": {"name": "threads", "output_dir": str(tmp_path), **run},
            "model": {"factory": "test_training_threads:probe_model"},
            "train": {"epochs": 1, "max_steps": 2, "batch_size": 16}}


def test_the_count_is_the_job_s_else_omp_num_threads_else_the_cores_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert available_cores() == 16
    assert intra_op_threads(load_job({})) == 16  # one process: every core, as torch does
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert intra_op_threads(load_job({})) == 4  # four on the host share them
    assert intra_op_threads(load_job({}), local=3) == 5
    assert intra_op_threads(load_job({}), local=40) == 1  # at least one each
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert intra_op_threads(load_job({})) == 3
    assert intra_op_threads(load_job({"run": {"num_threads": 2}})) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "lots")
    assert intra_op_threads(load_job({})) == 16


def test_a_local_run_trains_on_its_count_and_puts_the_caller_s_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        SEEN.clear()
        execute(load_job(_doc(tmp_path)))
        assert SEEN[-1] == available_cores() and torch.get_num_threads() == 3
        SEEN.clear()
        execute(load_job(_doc(tmp_path, num_threads=2)), overwrite=True)
        assert SEEN[-1] == 2 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [None, 2])
def test_each_worker_uses_the_job_s_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          num_threads: int | None) -> None:
    from paratrain.comm.launch import launch
    from paratrain.executors.entry import worker_entry

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = {"name": "threads", "output_dir": str(tmp_path)}
    if num_threads is not None:
        run["num_threads"] = num_threads
    job = load_job({"run": run, "strategy": {"type": "DataParallel", "num_replicas": 2,
                                             "aggregation": {"method": "AllReduce"}}})
    got = launch(job, nprocs=2, entry=worker_entry, target="test_training_threads:report_threads")
    assert got == (num_threads or max(1, available_cores() // 2))  # two share the host
