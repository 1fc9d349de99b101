"""Issue 21 item 2: training batches come through torch's DataLoader with the loop's order
as its sampler (paratrain.data.loader).

* ``num_workers = 2`` ends with the parameters of ``num_workers = 0`` on a deterministic
  dataset (digits), Local and DataParallel x2 (loader workers forked inside the ranks);
* a dataset drawing a random augmentation per item gives the same parameters with 1 and 2
  workers (each batch is drawn under a seed of (seed, epoch, batch)), and a run SIGKILLed
  mid-epoch with 2 workers, resumed, ends with the uninterrupted run's parameters;
* the loader's processes have ended when ``fit`` returns; Ctrl-C to a CLI run with 2
  workers (the whole process group) stops it with a checkpoint (exit 130), leaves no
  process of its session behind, and ``--resume`` ends with the uninterrupted parameters
  (the resumes run in the test's process: the same code below the CLI);
* bad ``[data]`` loader keys are ConfigErrors naming the field.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import paratrain
from _interrupting import start_cli, wait_until
from paratrain.config import ConfigError, load_job
from paratrain.training.faults import FAULT_ENV
from paratrain.training.stores import latest_folder, read_rank_state

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(300)]


def _digits(tmp_path: Path, name: str, workers: int, **extra: Any) -> dict[str, Any]:
    return {"run": {"name": name, "seed": 3, "output_dir": str(tmp_path)},
            "model": {"name": "mlp", "hidden": [16]}, "data": {"num_workers": workers},
            "train": {"epochs": 2, "batch_size": 64, "optimizer": {"name": "sgd", "lr": 0.1}},
            **extra}


def _augmented(tmp_path: Path, name: str, workers: int, epochs: int = 2) -> dict[str, Any]:
    return {"run": {"name": name, "seed": 3, "output_dir": str(tmp_path)},
            "task": {"factory": "_data_tasks:make_task", "kind": "augmented"},
            "data": {"num_workers": workers},
            "train": {"epochs": epochs, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.1}}}


def _children() -> set[int]:
    """Live (non-zombie) child processes of this one."""
    pids = set()
    for tid in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (tid / "children").read_text().split():
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX":
                    pids.add(int(pid))
            except (OSError, IndexError):
                pass
    return pids


def test_two_workers_give_the_in_process_parameters_and_end_with_the_run(tmp_path: Path) -> None:
    before = _children()
    a = paratrain.fit(_digits(tmp_path, "w0", 0))
    b = paratrain.fit(_digits(tmp_path, "w2", 2, **{"data": {"num_workers": 2, "prefetch_factor": 3}}))
    assert a["steps"] == b["steps"] > 0
    assert a["parameters_sha256"] == b["parameters_sha256"]
    assert _children() <= before  # the loader's workers ended with the run


def test_random_augmentation_is_drawn_per_batch_whatever_the_workers(tmp_path: Path) -> None:
    one = paratrain.fit(_augmented(tmp_path, "a1", 1))
    two = paratrain.fit(_augmented(tmp_path, "a2", 2))
    inproc = paratrain.fit(_augmented(tmp_path, "a0", 0))
    assert one["parameters_sha256"] == two["parameters_sha256"]
    # non-vacuity: the augmentation is random (in process it draws from the training stream)
    assert inproc["parameters_sha256"] != two["parameters_sha256"]


def _fit_in_child(parent: Any, doc: dict[str, Any]) -> None:
    parent.apply()  # the test's environment (with the fault), working directory and sys.path
    paratrain.fit(doc)


def test_kill_mid_epoch_with_workers_resumes_bit_identical(tmp_path: Path) -> None:
    doc = _augmented(tmp_path, "full", 2, epochs=3)
    doc["run"]["checkpoint_every"] = 5
    full = paratrain.fit(doc)  # 16 batches an epoch: step 23 is mid-epoch 2
    doc["run"]["name"] = "killed"
    # the run in a child of the session's warm forkserver (no fresh interpreter importing torch),
    # with this process's environment plus the fault: SIGKILLed after step 23
    from paratrain.comm.forkserver import ParentState, context

    parent = ParentState(environ={**os.environ, FAULT_ENV: "0:23"}, stdio=(None, None))
    proc = context().Process(target=_fit_in_child, args=(parent, doc))
    proc.start()
    proc.join(240)
    assert proc.exitcode == -signal.SIGKILL
    saved = read_rank_state(latest_folder(tmp_path / "killed" / "checkpoints"))
    assert (saved["step"], saved["batch"]) == (20, 4)
    paratrain.fit(doc, resume=True)  # `paratrain run --resume`, in this process
    resumed = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert resumed["steps"] == full["steps"]
    assert resumed["parameters_sha256"] == full["parameters_sha256"]


def _in_session(sid: int) -> list[str]:
    """Live processes of session ``sid`` (as tests/comm/test_cli_waits_for_processes.py)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                out.append(entry.name)
    return out


def test_ctrl_c_with_workers_checkpoints_ends_every_process_and_resumes(tmp_path: Path) -> None:
    doc = _augmented(tmp_path, "full", 2, epochs=4)
    doc["task"]["work"] = 10  # ~1 ms an item: the run lasts long enough to be stopped
    doc["run"]["checkpoint_every"] = 5
    full = paratrain.fit(doc)
    doc["run"]["name"] = "stopped"
    path = tmp_path / "stopped.json"
    path.write_text(json.dumps(doc))
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT / 'src'}"}
    proc = start_cli(path, env=env)
    ckpts = tmp_path / "stopped" / "checkpoints"
    wait_until(lambda: latest_folder(ckpts) is not None, proc, what="a first checkpoint")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the CLI and its loader workers
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert _in_session(proc.pid) == []
    stopped_at = read_rank_state(latest_folder(ckpts))["step"]
    assert 0 < stopped_at < full["steps"]
    paratrain.fit(doc, resume=True)  # `paratrain run --resume`, in this process
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["parameters_sha256"] == full["parameters_sha256"]


def test_workers_inside_data_parallel_ranks(tmp_path: Path) -> None:
    dp = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    a = paratrain.fit(_digits(tmp_path, "dp0", 0, strategy=dp))
    b = paratrain.fit(_digits(tmp_path, "dp2", 2, strategy=dp))
    assert a["parameters_sha256"] == b["parameters_sha256"]


@pytest.mark.parametrize(("data", "field"), [
    ({"num_workers": -1}, "data.num_workers"),
    ({"num_workers": 65}, "data.num_workers"),
    ({"num_workers": "2"}, "data.num_workers"),
    ({"prefetch_factor": 0, "num_workers": 1}, "data.prefetch_factor"),
    ({"prefetch_factor": 2}, "data"),
])
def test_bad_loader_keys_name_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_job({"data": data})
    assert any(p[0] == field for p in e.value.problems), e.value.problems
