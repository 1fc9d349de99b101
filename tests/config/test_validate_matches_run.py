"""``paratrain validate`` and ``paratrain run`` agree on every broken job (issue 13 item 7).

Each job in ``tests/jobs/broken/`` says which field is at fault (a ``# expect: FIELD``
line; JSON has no comments, so those are listed here). Both commands must exit 2 and
name the same fields, and ``run`` must fail before it spawns any process or creates a
run folder (:mod:`paratrain.preflight` runs the same checks for both).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.config import ConfigError, JobConfig
from paratrain.preflight import PROCS_PER_CORE, PreflightWarning, preflight, process_limit

BROKEN = Path(__file__).resolve().parents[1] / "jobs" / "broken"
JOB_SUFFIXES = {".toml", ".json", ".yaml", ".yml"}
# JSON cannot carry a comment line.
JSON_EXPECT = {
    "float_count.json": "strategy.num_clients",
    "tp.json": "tensor_parallel.tensor_parallel_size",
}


def _jobs() -> list[Path]:
    return sorted(p for p in BROKEN.iterdir() if p.suffix in JOB_SUFFIXES)


def _header(path: Path, key: str) -> str | None:
    for line in path.read_text().splitlines():
        m = re.fullmatch(rf"#\s*{key}:\s*(\S+)\s*", line)
        if m:
            return m.group(1)
    return None


def _expected(path: Path) -> str:
    found = _header(path, "expect") or JSON_EXPECT.get(path.name)
    assert found, f"{path.name}: add a '# expect: <field.path>' line"
    return found


def _fields(err: str, path: Path) -> set[str]:
    """Field paths of the ``PATH: FIELD: message`` lines of ``err``."""
    out: set[str] = set()
    prefix = f"{path}: "
    for line in err.splitlines():
        if not line.strip() or ": warning: " in line:
            continue
        assert line.startswith(prefix), line
        out.add(line[len(prefix):].split(": ", 1)[0])
    return out


def test_every_broken_job_names_its_field() -> None:
    jobs = _jobs()
    assert len(jobs) >= 40
    for p in jobs:
        _expected(p)


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to launch worker processes fails the test."""
    import torch.distributed.launcher.api as api

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a broken job launched worker processes")

    monkeypatch.setattr(api, "elastic_launch", refuse)
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun


@pytest.mark.parametrize("path", _jobs(), ids=lambda p: p.name)
def test_validate_and_run_fail_on_the_same_field(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], no_spawn: None,
) -> None:
    if _header(path, "when") == "no-cuda" and torch.cuda.is_available():
        pytest.skip("valid where CUDA is available")
    monkeypatch.chdir(tmp_path)  # run.output_dir "runs" lands under tmp_path
    expected = _expected(path)

    started = time.perf_counter()
    assert main(["validate", str(path)]) == 2
    v_err = capsys.readouterr().err
    assert main(["run", "-q", str(path)]) == 2
    r_err = capsys.readouterr().err
    elapsed = time.perf_counter() - started

    for err in (v_err, r_err):
        assert "Traceback" not in err, err
    v_fields, r_fields = _fields(v_err, path), _fields(r_err, path)
    assert expected in v_fields, (expected, v_err)
    assert v_fields == r_fields, (v_err, r_err)
    assert not (tmp_path / "runs").exists(), "run created a run folder before failing"
    assert elapsed < 60, f"{elapsed:.1f} s: a broken job should fail before any training"


def test_a_job_next_to_its_plugin_runs_its_factory_without_pythonpath(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run.imports = ["my_models.py"]`` makes ``my_models:build`` importable."""
    (tmp_path / "my_models_preflight.py").write_text(
        "from torch import nn\n"
        "def build(*, input_shape, num_classes, width=8):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, num_classes))\n"
    )
    job = tmp_path / "job.toml"
    job.write_text(
        '[run]\nname = "plug"\nimports = ["my_models_preflight.py"]\n'
        f'output_dir = "{tmp_path / "runs"}"\n'
        '[model]\nfactory = "my_models_preflight:build"\nwidth = 12\n'
        "[train]\nepochs = 1\nmax_steps = 2\n"
    )
    assert main(["validate", str(job)]) == 0, capsys.readouterr().err
    assert main(["run", "-q", str(job)]) == 0, capsys.readouterr().err
    assert (tmp_path / "runs" / "plug" / "summary.json").is_file()


def _dp(replicas: int, **run: object) -> JobConfig:
    return JobConfig.model_validate({
        "run": run, "train": {"batch_size": 1},
        "strategy": {"type": "DataParallel", "num_replicas": replicas, "aggregation": {"method": "AllReduce"}},
    })


def test_process_limit_allows_four_ranks_per_core_and_can_be_lifted() -> None:
    limit = process_limit()
    assert limit == (os.cpu_count() or 1) * PROCS_PER_CORE and limit >= 4
    preflight(_dp(limit))  # at the limit: fine
    with pytest.raises(ConfigError) as info:
        preflight(_dp(limit + 1))
    assert [p for p, _ in info.value.problems] == ["strategy.num_replicas"]
    assert "allow_oversubscribe" in info.value.problems[0][1]
    preflight(_dp(limit + 1, allow_oversubscribe=True))


def test_federated_workers_beyond_clients_are_capped_with_a_warning() -> None:
    from paratrain.executors.federated import num_workers

    job = JobConfig.model_validate({"run": {"num_workers": 6}, "strategy": {
        "type": "Federated", "num_clients": 3, "rounds": 1, "aggregation": {"method": "FedAvg"},
        "client_selection": {"method": "All"}}})
    assert num_workers(job) == 3
    with pytest.warns(PreflightWarning, match=r"run.num_workers: 6 workers for 3 clients; capped at 3"):
        notes = preflight(job)
    assert len(notes) == 1


def test_plugin_file_never_shadows_another_module(tmp_path: Path) -> None:
    import json

    from paratrain.executors import import_plugins

    (tmp_path / "json.py").write_text("VALUE = 1\n")
    import_plugins(["json.py"], base=tmp_path)
    assert sys.modules["json"] is json and sys.modules["paratrain_plugin_json"].VALUE == 1
