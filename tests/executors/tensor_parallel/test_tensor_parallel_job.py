"""The tensor-parallel executor: a 2-D (TP 2 x DP 2) job on 4 real processes through the
elastic launcher, its gathered dense model, and the layout errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.config import ConfigError, load_job
from paratrain.data import load_data
from paratrain.dispatch import execute
from paratrain.executors import executor_name
from paratrain.executors.tensor_parallel.runner import layout
from paratrain.files import step_folders
from paratrain.models import build_model
from paratrain.task import evaluate, resolve_task
from paratrain.training.export import read_model

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _job(name: str, tmp: Path, **train: int) -> object:
    doc = load_job(EXAMPLES / name).to_json_dict()
    doc["run"]["output_dir"] = str(tmp)
    doc["train"].update(train)
    return load_job(doc)


def test_examples_route_to_the_tensor_parallel_executor(tmp_path: Path) -> None:
    for name, world in [("tensor_parallel_mlp.toml", 2), ("tensor_parallel_2d.toml", 4)]:
        job = _job(name, tmp_path)
        assert executor_name(job) == "TensorParallel"
        _, tp, dp = layout(job)
        assert tp * dp == world


@pytest.mark.parametrize("patch,field", [
    ({"strategy": {"type": "DataParallel", "num_replicas": 2,
                   "aggregation": {"method": "ParameterServer"}}}, "strategy.aggregation.method"),
    ({"compression": {"method": "TopK", "k": 10}}, "compression"),  # one replica: nothing to compress
])
def test_layout_errors(tmp_path: Path, patch: dict, field: str) -> None:
    doc = load_job(EXAMPLES / "tensor_parallel_mlp.toml").to_json_dict()
    doc.update(patch)
    with pytest.raises(ConfigError) as e:
        layout(load_job(doc))
    assert e.value.problems[0][0] == field


@pytest.fixture(scope="module")
def dense_2d(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, dict, Path]:
    """One uninterrupted TP 2 x DP 2 run of the example (30 steps), shared by the test of
    its summary and gathered model and by the compression test (its dense reference): one
    4-process launch instead of two."""
    out = tmp_path_factory.mktemp("dense_2d")
    job = _job("tensor_parallel_2d.toml", out, epochs=1, max_steps=30)
    return job, execute(job), out


@pytest.mark.slow
def test_two_d_job_trains_and_gathers_the_dense_model(dense_2d: tuple[object, dict, Path]) -> None:
    job, s, tmp_path = dense_2d
    assert s["world_size"] == 4 and s["tensor_parallel_size"] == 2 and s["data_parallel_size"] == 2
    assert s["steps"] == 30 and s["test_accuracy"] > 0.3  # chance is 0.1
    assert 0.45 < s["memory_saving_measured"] < 0.5
    # every figure says where it came from: bytes on the wire are modelled, the rest measured
    assert s["provenance"]["bytes_sent_per_step_modelled"] == "modelled"
    assert s["provenance"]["payload_bytes_per_step_measured"] == "measured"
    assert s["provenance"]["test_accuracy"] == "measured"
    # at p = 2 the ring model puts exactly the handed-over tensor on the wire
    assert s["payload_bytes_per_step_measured"] == pytest.approx(s["bytes_sent_per_step_modelled"])
    assert s["payload_bytes_per_step_measured"] > 0
    # the gathered model.safetensors is the full model: the dense net with it scores the same
    bundle = load_data(job.data, seed=job.run.seed)
    net = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    net.load_state_dict(read_model(s["dense_model"]))
    ev = evaluate(net, resolve_task(job), bundle.test)
    assert ev["accuracy"] == pytest.approx(s["test_accuracy"], abs=1e-9)
    assert ev["loss"] == pytest.approx(s["test_loss"], rel=1e-4)
    assert (tmp_path / "tensor_parallel_2d" / "summary.json").exists()
    assert step_folders(tmp_path / "tensor_parallel_2d" / "checkpoints")


@pytest.mark.slow
def test_two_d_job_compresses_the_data_parallel_exchange(
    tmp_path: Path, dense_2d: tuple[object, dict, Path]
) -> None:
    """TP 2 x DP 2 with [compression]: TopK keeping every entry equals the dense run (the
    compressed path is exercised: its bytes are counted); TopK 200 per tensor with error feedback
    sends under a quarter of the dense bytes (measured 0.08) (values + indices), still learns, and differs from the
    dense run (non-vacuity)."""
    def run(name: str, compression: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        doc = load_job(EXAMPLES / "tensor_parallel_2d.toml").to_json_dict()
        doc["run"].update(output_dir=str(tmp_path), name=name)
        doc["train"].update(epochs=1, max_steps=30)
        doc["compression"] = compression
        s = execute(load_job(doc))
        return s, read_model(s["dense_model"])

    # the dense run is the shared fixture's: the same example, epochs=1, max_steps=30
    dense = dense_2d[1]
    w_dense = read_model(dense["dense_model"])
    full, w_full = run("full", {"method": "TopK", "k": 1 << 30})
    topk, w_topk = run("topk", {"method": "ErrorFeedback", "error_compensation": True,
                                "base_strategy": {"method": "TopK", "k": 200}})
    assert "compression" not in dense and full["compression"]["original_bytes"] > 0
    for k in w_dense:
        torch.testing.assert_close(w_full[k], w_dense[k], rtol=1e-5, atol=1e-6)
    ratio = (topk["dp_payload_bytes_sent_per_step_measured"]
             / full["dp_payload_bytes_sent_per_step_measured"])
    assert ratio < 0.25, ratio
    # 30 steps of 16 rows per replica: dense 0.53, TopK+EF 0.54 (chance is 0.1)
    assert topk["test_accuracy"] > max(0.3, dense["test_accuracy"] - 0.15)
    assert any(not torch.allclose(w_topk[k], w_dense[k], rtol=1e-3, atol=1e-5) for k in w_dense)


@pytest.mark.slow
def test_resume_from_sharded_checkpoints_matches_uninterrupted(tmp_path: Path) -> None:
    from _workers_tp import job_resume
    from paratrain.comm.testing import run_distributed

    r = run_distributed(job_resume, 2, str(tmp_path), timeout_s=240)[0]
    assert r["steps"] == (6, 6)
    assert r["full"] == r["resumed"]
    assert step_folders(tmp_path / "split" / "checkpoints")


@pytest.fixture(scope="module")
def resume_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The two 4-rank resume cases (BlockWise grid; TP 2 x DP 2 with error feedback), each
    with its own output directory, in one launch of the 4 processes."""
    from _workers_tp import job_resume_cases
    from paratrain.comm.testing import run_distributed

    blockwise = {"tensor_parallel": {"tensor_parallel_size": 4, "partitioning_strategy": "BlockWise",
                                     "micro_batches": 2, "memory_optimization": "High"}}
    ef = {"strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
          "compression": {"method": "ErrorFeedback", "error_compensation": True,
                          "base_strategy": {"method": "TopK", "k": 16}}}
    cases = [(str(tmp_path_factory.mktemp("blockwise")), blockwise),
             (str(tmp_path_factory.mktemp("ef")), ef)]
    r = run_distributed(job_resume_cases, 4, cases, timeout_s=300)[0]
    return {"blockwise": r[0], "ef": r[1]}


@pytest.mark.slow
def test_blockwise_grid_resume_matches_uninterrupted(resume_4: dict[str, dict]) -> None:
    """BlockWise on a 2 x 2 grid (4 ranks, each keeping a quarter of every weight): 3
    steps + resume to 6 end bit-identical to 6 uninterrupted steps; the gathered dense
    model (the summary's digest) is the same."""
    r = resume_4["blockwise"]
    assert r["steps"] == (6, 6)
    assert r["full"] == r["resumed"]
    assert r["acc"] > 0.1  # the gathered dense model evaluates (chance is 0.1)


@pytest.mark.slow
def test_resume_with_error_feedback_residuals_matches_uninterrupted(resume_4: dict[str, dict]) -> None:
    """TP 2 x DP 2 with TopK + error feedback: the residuals are in each rank's checkpoint,
    so 3 steps + resume to 6 ends bit-identical to 6 uninterrupted steps."""
    r = resume_4["ef"]
    assert r["steps"] == (6, 6)
    assert r["full"] == r["resumed"]


def test_layout_errors_surface_before_launch(tmp_path: Path) -> None:
    from paratrain.executors.tensor_parallel.runner import dry_run

    doc = load_job(EXAMPLES / "tensor_parallel_mlp.toml").to_json_dict()
    dry_run(load_job(doc))  # the example itself is fine
    doc["model"] = {"name": "transformer", "d_model": 30, "heads": 3}
    with pytest.raises(ConfigError, match="3 heads, not divisible by tensor_parallel_size 2"):
        execute(load_job(doc))
    doc["model"] = {"name": "mlp"}
    doc["strategy"] = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    doc["tensor_parallel"]["partitioning_strategy"] = "BlockWise"  # 2 x 2 grid: 2-D TP,
    doc["tensor_parallel"]["tensor_parallel_size"] = 4  # which has no sequence-parallel form
    doc["tensor_parallel"]["communication_pattern"] = "ReduceScatter"
    with pytest.raises(ConfigError, match="does not combine with ReduceScatter"):
        execute(load_job(doc))
