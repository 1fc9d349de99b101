"""ModelParallel through the full job path (``execute`` -> ``comm.launch`` -> worker_main):
DataStore training equals Local training; a Pipeline job whose rank is SIGKILLed midway
is restarted by the elastic agent from the per-rank checkpoints and ends where the
uninterrupted run ends; ``resume=True`` then continues it further; a worker raising mid-step
ends the CLI's run with its error. (Eight worker-process starts in all: the test-time budget.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paratrain.config import ConfigError
from paratrain.config.job import JobConfig
from paratrain.dispatch import execute
from paratrain.executors.model_parallel.runner import FAULT_ENV
from paratrain.files import step_folders
from paratrain.training import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _job(tmp: Path, name: str, strategy: dict[str, Any], max_steps: int, **extra: Any) -> JobConfig:
    return JobConfig.model_validate({
        "run": {"name": name, "seed": 3, "output_dir": str(tmp), "checkpoint_every": 4},
        "model": {"name": "mlp", "hidden": [32, 16]},
        "train": {"epochs": 1, "batch_size": 24, "max_steps": max_steps, "eval_every": 4,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "strategy": strategy,
        **extra,
    })


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return execute(_job(tmp_path_factory.mktemp("local"), "local", {"type": "Local"}, 8))


SPLIT = [{"node_ids": ["fc0", "act0", "head"], "target": {"WorkerId": "worker-1"}}]


@pytest.fixture(scope="module")
def datastore(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    strategy = {"type": "ModelParallel", "communication": {"protocol": "DataStore"}, "partitions": SPLIT}
    return execute(_job(tmp_path_factory.mktemp("ds"), "ds", strategy, 8))


def test_datastore_job_matches_local(datastore: dict[str, Any], local: dict[str, Any]) -> None:
    out = datastore
    assert out["protocol"] == "DataStore" and out["steps"] == 8 and out["workers"] == 2
    assert [(s["rank"], s["nodes"]) for s in out["stages"]] == [
        (0, ["flatten"]), (1, ["fc0", "act0"]), (0, ["fc1", "act1"]), (1, ["head"])]
    assert out["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    assert out["test_accuracy"] == local["test_accuracy"]
    run = Path(out["run_dir"])
    assert json.loads((run / "summary.json").read_text())["test_loss"] == out["test_loss"]
    assert [r["step"] for r in read_metrics(run)] == [4, 8]
    assert json.loads((step_folders(run / "checkpoints")[-1] / "layout.json").read_text())["kind"] == "mp"
    assert not list((run / "datastore").rglob("*.pt")), "every exchanged file was consumed"


WORKERS2 = [{"id": "first"}, {"id": "second", "tags": ["mid"]}]


def test_sigkill_elastic_restart_then_resume_pipeline(tmp_path: Path, local: dict[str, Any],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline (1F1B, micro-batches 10/10/4): rank 1 dies after step 6; the elastic agent
    restarts both ranks from the step-4 checkpoints (parameters, momentum buffers, RNG,
    position) and the run ends where the uninterrupted Local run ends."""
    monkeypatch.setenv(FAULT_ENV, "1:6")
    strategy = {"type": "ModelParallel",
                "communication": {"protocol": "Pipeline", "micro_batch_size": 10},
                "partitions": [{"node_ids": ["fc1", "act1", "head"], "target": {"Tag": "mid"}}]}
    job = _job(tmp_path, "killed", strategy, 8, workers=WORKERS2)
    job = job.model_copy(update={"run": job.run.model_copy(update={"max_restarts": 1})})
    out = execute(job)
    assert out["restart_count"] == 1 and out["resumed_from_step"] == 4 and out["steps"] == 8
    assert out["schedule"] == "1F1B" and [s["worker"] for s in out["stages"]] == ["first", "second"]
    assert out["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    assert [r["step"] for r in read_metrics(out["run_dir"])] == [4, 8]
    # Pipeline statistics: p = 2 stages, m = 3 micro-batches of a full batch.
    assert out["bubble_theory_modelled"] == pytest.approx(1 / 4)
    assert 0.0 <= out["bubble_fraction_measured"] < 1.0
    assert out["provenance"]["bubble_theory_modelled"] == "modelled"
    assert out["provenance"]["stage_stats"] == "measured"
    stats = out["stage_stats"]
    assert [s["rank"] for s in stats] == [0, 1]
    for s in stats:
        assert 0 < s["compute_fraction_measured"]
        assert s["compute_fraction_measured"] + s["blocked_in_recv_fraction_measured"] <= 1.0
        assert s["peak_activation_bytes_measured"] > 0
    # the cut is after act0 (32 wide): rank 0 sends 24 x 32 activations, rank 1 their grads
    assert (stats[0]["bytes_sent_per_step_measured"] == stats[1]["bytes_sent_per_step_measured"]
            == 24 * 32 * 4)

    # `--resume` continues the finished run from its step-8 checkpoints to step 12.
    monkeypatch.delenv(FAULT_ENV)
    job12 = _job(tmp_path, "killed", strategy, 12, workers=WORKERS2)
    more = execute(job12, resume=True)
    assert more["resumed_from_step"] == 8 and more["steps"] == 12 and more["restart_count"] == 0
    local12 = execute(_job(tmp_path, "local12", {"type": "Local"}, 12))
    assert more["test_loss"] == pytest.approx(local12["test_loss"], rel=1e-5)
    assert [r["step"] for r in read_metrics(more["run_dir"])] == [4, 8, 12]


def test_job_errors_before_launch(tmp_path: Path) -> None:
    bad = {"type": "ModelParallel", "communication": {"protocol": "Pipeline", "micro_batch_size": 4},
           "partitions": [{"node_ids": ["fc0"], "target": {"WorkerId": "worker-1"}}]}
    with pytest.raises(ConfigError, match="one contiguous run"):
        execute(_job(tmp_path, "bad", bad, 2))
    unknown = dict(bad, communication={"protocol": "Direct"},
                   partitions=[{"node_ids": ["fc7"], "target": {"Tag": "gpu"}}])
    with pytest.raises(ConfigError) as info:
        execute(_job(tmp_path, "bad", unknown, 2))
    assert {p for p, _ in info.value.problems} == {"strategy.partitions[0].node_ids",
                                                   "strategy.partitions[0].target.Tag"}


_BOOM = '''
from collections import OrderedDict

from torch import nn

from paratrain.graph import leaf


@leaf
class Boom(nn.Module):
    """Raises in its third training forward: one micro-batch into the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom: a worker failed mid-step")
        return x


def build(input_shape, num_classes):
    return nn.Sequential(OrderedDict(flat=nn.Flatten(), fc0=nn.Linear(input_shape[-1], 16),
                                     boom=Boom(), head=nn.Linear(16, num_classes)))
'''


def test_a_worker_raising_mid_step_ends_the_run_with_its_error(tmp_path: Path) -> None:
    """The failing rank aborts its transport instead of flushing sends no peer will take
    (runner._transport), so the CLI ends promptly with the worker's error: no hang."""
    import subprocess
    import sys

    (tmp_path / "boom_model.py").write_text(_BOOM)
    job = _job(tmp_path, "boom", {
        "type": "ModelParallel", "partitions": [{"node_ids": ["boom", "head"], "target": {"WorkerId": "worker-1"}}],
        "communication": {"protocol": "Pipeline", "schedule": "1F1B", "micro_batch_size": 12}}, 4)
    doc = job.to_json_dict()
    doc["model"] = {"factory": "boom_model:build"}
    doc["run"]["imports"] = [str(tmp_path / "boom_model.py")]
    path = tmp_path / "boom.json"
    path.write_text(json.dumps(doc))
    # a hang is this timeout (about 25 s on a quiet machine; the comm timeout is 300 s)
    out = subprocess.run([sys.executable, "-m", "paratrain.cli", "run", str(path), "-q"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode != 0
    assert "RuntimeError: boom: a worker failed mid-step (worker 1;" in out.stderr


def test_an_error_aborts_the_transport_and_a_clean_exit_closes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() flushes pending sends, which wait forever on a peer that failed: after an
    error the runner's transport is aborted instead (no process needed to see which)."""
    from types import SimpleNamespace

    import paratrain.comm.p2p as p2p
    from paratrain.executors.model_parallel import runner

    calls: list[str] = []

    class Recording:
        def __init__(self, group: Any, device: Any = None) -> None:
            pass

        def close(self) -> None:
            calls.append("close")

        def abort(self) -> None:
            calls.append("abort")

    monkeypatch.setattr(p2p, "P2PTransport", Recording)
    job = _job(tmp_path, "t", {"type": "ModelParallel", "partitions": SPLIT,
                               "communication": {"protocol": "Direct"}}, 1)
    ctx: Any = SimpleNamespace(group=None, device=None)
    with pytest.raises(RuntimeError, match="mid-step"), runner._transport(ctx, job, tmp_path):
        raise RuntimeError("mid-step")
    with runner._transport(ctx, job, tmp_path):
        pass
    assert calls == ["abort", "close"]
