"""The acceptance matrix of issue 20: every strategy survives every way a run is stopped.

For each of the six strategies (Local, DataParallel, ModelParallel, Federated,
PopulationBased, Custom -- a registered coordinator training through paratrain's own loop,
``_kill_resume_coordinator.py``) a run is

- ``kill``: SIGKILLed mid-run by ``PARATRAIN_FAULT_KILL=RANK:STEP`` (a worker after step /
  round / generation STEP, past the last checkpoint): the elastic agent restarts the group
  (``run.max_restarts = 1``); a one-process run (a real ``paratrain run`` CLI process, the
  process that dies) is restarted with ``--resume``;
- ``save``: SIGKILLed while writing a checkpoint file (``PARATRAIN_FAULT_KILL_IN_SAVE``),
  leaving its temp file, then restarted the same way;
- ``sigint``: a real ``paratrain run`` CLI process sent SIGINT as Ctrl-C sends it (the CLI's
  whole process group) mid-run: it checkpoints at the next step / round / generation
  boundary and exits 130; ``--resume`` finishes it.

The reference runs, the restarts by ``--resume`` and the launches whose worker is killed
(kill, save of a multi-process strategy: the launching process's elastic agent restarts the
group, the same ``comm.launch`` below the CLI; tests/comm/test_cli_waits_for_processes.py runs the
CLI around a killed worker) run in the test's process, without another interpreter's
start-up and its workers' server. Every run then ends with the ``parameters_sha256`` of the
same job run without a stop, bit for bit, and no checkpoint temp file is left anywhere in its
run folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from _interrupting import start_cli, wait_until
from paratrain.config import load_job
from paratrain.dispatch import execute
from paratrain.training.faults import FAULT_ENV, KILL_IN_SAVE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parents[1]
# checkpoint.save_checkpoint's temp name (Federated, PopulationBased) and the one loop's
# temp folder of a torch.distributed.checkpoint save (training/stores.py)
TEMP = re.compile(r"^\.([a-z]+-\d{6,9}\.pt\.[a-z0-9_]{8}|step-\d{9}\.tmp)$")
ONE_PROCESS = ("Local", "Custom")  # the CLI process itself trains: a restart is `--resume`

_STEPS = {"run": {"checkpoint_every": 20},
          "train": {"epochs": 100, "batch_size": 32, "max_steps": 300, "eval_every": 20}}
MP_SPLIT = [{"node_ids": ["fc0", "act0", "head"], "target": {"WorkerId": "worker-1"}}]
TOPK_EF = {"method": "ErrorFeedback", "error_compensation": True,
           "base_strategy": {"method": "TopK", "k": 200}}

# strategy -> (job sections, the kill spec, the checkpoint file whose save is killed)
CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "Local": (_STEPS, "0:30", "step-000000040"),
    # a model whose gradient bucket (~0.65 MB) is summed in shared memory (comm/shm.py)
    "DataParallel": ({**_STEPS, "model": {"name": "mlp", "hidden": [512, 256]},
                      "strategy": {"type": "DataParallel", "num_replicas": 2,
                                   "aggregation": {"method": "AllReduce"}}},
                     "1:30", "step-000000040"),
    "ModelParallel": ({**_STEPS, "strategy": {"type": "ModelParallel", "partitions": MP_SPLIT,
                                              "communication": {"protocol": "Direct"}}},
                      "1:30", "step-000000040"),
    # rounds: checkpoints every 2; stateful clients (error-feedback residuals) on every worker
    "Federated": ({"run": {"checkpoint_every": 2, "num_workers": 2},
                   "strategy": {"type": "Federated", "num_clients": 4, "rounds": 8,
                                "aggregation": {"method": "FedAvg"},
                                "client_selection": {"method": "All"}},
                   "federated": {"local_epochs": 1, "batch_size": 16}, "compression": TOPK_EF},
                  "1:3", "step-000000004"),
    # generations: rank 1 dies having trained generation 2, before the population checkpoint
    "PopulationBased": ({"run": {"num_workers": 2},
                         "strategy": {"type": "PopulationBased", "population_size": 2, "generations": 6,
                                      "exploit": {"method": "Truncation", "fraction": 0.5},
                                      "explore": {"method": "Perturbation", "factor": 0.3}},
                         "population": {"steps_per_generation": 40},
                         "search_space": {"lr": {"type": "log_uniform", "low": 0.01, "high": 0.3}}},
                        "1:3", "step-000000003"),
    "Custom": ({**_STEPS, "strategy": {"type": "Custom", "coordinator": "kill-resume-own-loop",
                                       "config": None},
                "run": {**_STEPS["run"], "imports": [str(HERE / "_kill_resume_coordinator.py")]}},
               "0:30", "step-000000040"),
}


def _job(tmp: Path, kind: str, name: str) -> Path:
    sections = CASES[kind][0]
    doc: dict[str, Any] = {
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
        **{k: v for k, v in sections.items() if k not in ("run", "train")},
    }
    doc["run"] = {"name": "r", "seed": 7, "output_dir": str(tmp / name), **sections.get("run", {})}
    if kind not in ONE_PROCESS:
        doc["run"]["max_restarts"] = 1
    doc["train"].update(sections.get("train", {}))
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def _resume(job: Path) -> None:
    """``paratrain run JOB --resume``, in this process."""
    execute(load_job(json.loads(job.read_text())), resume=True)


def _run(job: Path) -> None:
    """``paratrain run JOB``, in this process."""
    execute(load_job(json.loads(job.read_text())))


def _finish(proc: subprocess.Popen[str], code: int = 0) -> str:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    return err


def _digest(run_dir: Path) -> str:
    return str(json.loads((run_dir / "summary.json").read_text())["parameters_sha256"])


def _temps(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob(".*") if TEMP.match(p.name)]


def _progress(run_dir: Path) -> bool:
    """Whether the run has logged its first evaluation (step, round or generation)."""
    return any(any(line.endswith("}") for line in m.read_text().splitlines())
               for m in run_dir.rglob("metrics.jsonl"))


_REFERENCE: dict[str, str] = {}


def _reference(tmp_factory: pytest.TempPathFactory, kind: str) -> str:
    if kind not in _REFERENCE:
        tmp = tmp_factory.mktemp(f"ref-{kind}")
        execute(load_job(json.loads(_job(tmp, kind, "ref").read_text())))
        _REFERENCE[kind] = _digest(tmp / "ref" / "r")
    return _REFERENCE[kind]


@pytest.mark.parametrize("fault", ["kill", "save", "sigint"])
@pytest.mark.parametrize("kind", list(CASES))
def test_stopped_run_resumes_bit_identical(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str], kind: str, fault: str) -> None:
    job = _job(tmp_path, kind, "run")
    run_dir = tmp_path / "run" / "r"
    _, kill_at, save_file = CASES[kind]
    if fault == "sigint":
        proc = start_cli(job)
        wait_until(lambda: _progress(run_dir), proc)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the CLI and every worker it started
        assert "--resume" in _finish(proc, 130)
        assert not (run_dir / "summary.json").exists()  # stopped before the end
        _resume(job)
    else:
        env = {FAULT_ENV: kill_at} if fault == "kill" else {KILL_IN_SAVE_ENV: save_file}
        if kind in ONE_PROCESS:
            _finish(start_cli(job, env=env), -signal.SIGKILL)
            if fault == "save":
                assert _temps(run_dir), "the save was not interrupted"
            _resume(job)
        else:  # the workers this process launches inherit its environment
            with monkeypatch.context() as m:
                for key, value in env.items():
                    m.setenv(key, value)
                capfd.readouterr()
                _run(job)
            err = capfd.readouterr().err
            assert "restarted from" in err, err[-3000:]  # a worker really died
            # in the strategy's own count (Federated counts rounds, PopulationBased generations)
            unit = {"Federated": "round", "PopulationBased": "generation"}.get(kind, "step")
            assert re.search(rf"restarted from {unit} \d+", err), err[-3000:]
    assert not _temps(run_dir), _temps(run_dir)
    assert _digest(run_dir) == _reference(tmp_path_factory, kind)
