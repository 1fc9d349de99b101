"""What `paratrain run` prints when a worker process fails, restarts or is interrupted
(real processes through the elastic launcher, as a user runs them):

* a SIGKILLed worker that the agent restarts is one line, ``worker 1 died (SIGKILL);
  restarted from step 4``, and the run finishes;
* an exception in a worker is one line (``error: ValueError: ...`` naming the worker and
  its log, exit 1; a ConfigError is the line ``validate`` would print, exit 2) and the
  traceback is in ``runs/<name>/worker-<rank>.log``;
* the same under torchrun (``python -m paratrain.worker``, in-process);
* Ctrl-C (SIGINT to the whole process group) or SIGTERM to the launcher prints
  ``interrupted; continue with --resume`` and exits 130.

No torch traceback or launcher log line reaches the console in any of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.files import step_folders

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PARATRAIN = str(Path(sys.executable).parent / "paratrain")

JOB = """
[run]
name = "{name}"
seed = 0
output_dir = "{out}"
max_restarts = {restarts}
checkpoint_every = 2

[model]
name = "mlp"
hidden = [8]

[train]
epochs = {epochs}
batch_size = 16
max_steps = {steps}

[strategy]
type = "DataParallel"
num_replicas = 2
aggregation = {{ method = "AllReduce" }}
"""

PLUGIN = '''
import os

import torch

from paratrain.config import ConfigError
from paratrain.files import step_folders


def make(input_shape, num_classes, **kwargs):
    if os.environ.get("RANK") == os.environ.get("PLUGIN_RANK", "1"):
        if os.environ.get("PLUGIN_RAISES") == "config":
            raise ConfigError([("model.hidden", "rank one rejects it")])
        raise ValueError("bad shard 7 on rank one")
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))
'''


TRAIN_FAILS = '''
import torch


class Fails(torch.nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))

    def forward(self, x):
        if x.shape[0] == 16:
            raise ValueError("bad batch in training")
        return self.net(x)


def make(input_shape, num_classes, **kwargs):
    return Fails(num_classes)
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
           and not k.startswith(("PARATRAIN_", "TORCHELASTIC_"))}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def _no_torch_noise(stderr: str) -> None:
    for needle in ("Traceback", "torch.distributed", "torch/multiprocessing", "ChildFailedError"):
        assert needle not in stderr, stderr


def test_a_killed_worker_restarts_with_one_line(tmp_path: Path) -> None:
    job = tmp_path / "kill.toml"
    job.write_text(JOB.format(name="kill", out=tmp_path / "runs", restarts=1, epochs=1, steps=8))
    # Rank 1 SIGKILLs itself after step 5; the last complete checkpoint is step 4.
    proc = subprocess.run([PARATRAIN, "run", str(job), "--quiet"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=540, env=_env(PARATRAIN_FAULT_KILL="1:5"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == ["worker 1 died (SIGKILL); restarted from step 4"]
    _no_torch_noise(proc.stderr)
    summary = json.loads((tmp_path / "runs" / "kill" / "summary.json").read_text())
    assert summary["restart_count"] == 1 and summary["steps"] == 8
    assert "killed by SIGKILL" in (tmp_path / "runs" / "kill" / "worker-1.log").read_text()


@pytest.mark.parametrize("kind", ["value", "config"])
def test_a_worker_exception_is_one_line_and_the_traceback_is_in_its_log(tmp_path: Path, kind: str) -> None:
    doc = {
        # A ConfigError is not retried (it would fail the same way): restarts allowed.
        "run": {"name": "boom", "seed": 0, "output_dir": str(tmp_path / "runs"),
                "max_restarts": 2 if kind == "config" else 0, "imports": ["plugin.py"]},
        "model": {"name": None, "factory": "paratrain_plugin_plugin:make"},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": 4},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
    }
    job = tmp_path / "jobs" / "boom.json"  # not the working directory: plugins resolve next to the job
    job.parent.mkdir()
    job.write_text(json.dumps(doc))
    (job.parent / "plugin.py").write_text(PLUGIN)
    proc = subprocess.run([PARATRAIN, "run", str(job), "--quiet"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=540, env=_env(PLUGIN_RAISES=kind))
    log = tmp_path / "runs" / "boom" / "worker-1.log"
    if kind == "config":
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"{job}: model.hidden: rank one rejects it"]
    else:
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: ValueError: bad shard 7 on rank one (worker 1; traceback in {log})"
        ]
    _no_torch_noise(proc.stderr)
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "plugin.py" in text and "rank one" in text


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_says_how_to_continue(tmp_path: Path, how: str) -> None:
    job = tmp_path / "long.toml"
    job.write_text(JOB.format(name="long", out=tmp_path / "runs", restarts=0, epochs=1000, steps=100_000))
    proc = subprocess.Popen([PARATRAIN, "run", str(job), "--quiet"], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        # Interrupt once both workers are training (each has written a checkpoint).
        ckpts = tmp_path / "runs" / "long" / "checkpoints"
        deadline = time.monotonic() + 400
        while not step_folders(ckpts):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole group
        else:
            os.kill(proc.pid, signal.SIGTERM)  # the launcher only
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["interrupted; continue with --resume"]
    _no_torch_noise(stderr)


def test_under_torchrun_a_worker_exception_is_one_line_and_a_log(tmp_path: Path) -> None:
    """``python -m paratrain.worker`` (what torchrun runs) prints the same one line."""
    from paratrain.comm.testing import free_port

    doc = {
        "run": {"name": "tr", "seed": 0, "output_dir": str(tmp_path / "runs"), "imports": ["plugin.py"]},
        "model": {"factory": "paratrain_plugin_plugin:make"},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": 2},
        "strategy": {"type": "DataParallel", "num_replicas": 1, "aggregation": {"method": "AllReduce"}},
    }
    (tmp_path / "job.json").write_text(json.dumps(doc))
    # The preflight check builds the model and runs it on 2 rows in this same process:
    # fail in training proper (a batch of 16), not there.
    (tmp_path / "plugin.py").write_text(TRAIN_FAILS)
    env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PLUGIN_RANK="0")
    proc = subprocess.run([sys.executable, "-m", "paratrain.worker", str(tmp_path / "job.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    log = tmp_path / "runs" / "tr" / "worker-0.log"
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: ValueError: bad batch in training (worker 0; traceback in {log})"
    ]
    assert "Traceback (most recent call last)" in log.read_text()
