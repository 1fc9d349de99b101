"""Federated --resume against a checkpoint it cannot continue: another model or another
aggregation method (whose server optimizer state would silently start fresh) is a
ConfigError naming the field and the way out (exit 2 from the CLI), and the run folder,
job.json included, is left as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _workers_federated import fed_job
from paratrain import cli
from paratrain.config import ConfigError
from paratrain.executors.federated import run
from paratrain.training.rundir import LOCK_NAME

pytestmark = pytest.mark.timeout(300)

YOGI = {"method": "FedYogi", "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "eta": 0.03}


def _snapshot(d: Path) -> dict[str, bytes]:
    """Every file of run folder ``d`` but the lock and the failed attempt's worker log."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME and not p.name.startswith("worker-")}


def _job_file(tmp: Path, tag: str, **kw: Any) -> Path:
    p = tmp / f"{tag}.json"
    p.write_text(json.dumps(fed_job(tmp / "runs", "fed", **kw).to_json_dict()))
    return p


@pytest.mark.slow
def test_resume_with_another_model_on_two_workers_is_exit_2_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kw: dict[str, Any] = dict(K=4, rounds=2, num_workers=2, local_epochs=1)
    assert cli.main(["run", "-q", str(_job_file(tmp_path, "a", hidden=64, **kw))]) == 0
    folder = tmp_path / "runs" / "fed"
    before = _snapshot(folder)
    assert "job.json" in before and "checkpoints/step-000000002/layout.json" in before
    capsys.readouterr()
    kw["rounds"] = 3
    assert cli.main(["run", "-q", "--resume", str(_job_file(tmp_path, "b", hidden=32, **kw))]) == 2
    err = capsys.readouterr().err
    assert "model" in err and "fc0.weight" in err and "(64, 64)" in err and "(32, 64)" in err, err
    assert "--overwrite" in err and "Traceback" not in err, err
    assert _snapshot(folder) == before  # job.json too: nothing written before the check


@pytest.mark.parametrize("other", [{"method": "FedAvg"}, {"method": "FedAdam", "eta": 0.03, "tau": 1e-3}])
def test_resume_with_another_aggregation_names_the_field_and_changes_nothing(
    tmp_path: Path, other: dict[str, Any]
) -> None:
    kw: dict[str, Any] = dict(K=4, local_epochs=1)
    run(fed_job(tmp_path, "fed", rounds=2, agg=YOGI, **kw))
    folder = tmp_path / "fed"
    before = _snapshot(folder)
    with pytest.raises(ConfigError) as err:
        run(fed_job(tmp_path, "fed", rounds=3, agg=other, **kw), resume=True)
    msg = dict(err.value.problems)["strategy.aggregation.method"]
    assert "FedYogi" in msg and other["method"] in msg and "--overwrite" in msg
    assert "step-000000002" in msg
    assert _snapshot(folder) == before

    # The same method resumes (its server state continues).
    resumed = run(fed_job(tmp_path, "fed", rounds=3, agg=YOGI, **kw), resume=True)
    assert resumed["rounds"] == 3
