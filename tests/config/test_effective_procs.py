"""Issue 20 item 6: nothing a job sets is ignored silently. Process settings
(``run.max_restarts``/``num_workers``/``backend``, ``[[workers]]``, ``[comm]``) that the
job's strategy does not read are reported by effective_settings and printed by
``paratrain validate``; the tensor-parallel probe builds the model through the job's
``[task]``, so ``memory_optimization``/``fusion_threshold_bytes`` are judged for task
jobs too."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_effective_settings import DP, FED, MP, PBT

from paratrain.cli import main
from paratrain.config.job import load_job
from paratrain.dispatch import effective_settings
from paratrain.executors.tensor_parallel import probe_tp

LM = {"task": {"name": "language_model", "block_size": 16},
      "data": {"factory": "test_tp_task:tiny_lm_data"},
      "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32}}


def _ignored(doc: dict[str, Any]) -> dict[str, str]:
    return {i.field: i.reason for i in effective_settings(load_job(doc)).ignored}


def _validate(path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``paratrain validate`` on ``text`` (written to ``path``): exit 0, "ok"; its stderr."""
    path.write_text(textwrap.dedent(text))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr()
    assert f"{path}: ok" in out.out
    return out.err


# ------------------------------------------------------------ Local: one process


def test_local_reports_every_process_setting() -> None:
    got = _ignored({"run": {"max_restarts": 2, "num_workers": 3, "backend": "gloo"},
                    "workers": [{"id": "a"}], "comm": {"timeout_s": 30.0}})
    assert set(got) == {"run.max_restarts", "run.num_workers", "run.backend", "workers",
                        "comm.timeout_s"}
    assert all("Local run trains in this one process" in why for why in got.values())
    assert "restart" in got["run.max_restarts"] and "process group" in got["run.backend"]


def test_tensor_parallel_local_launches_processes_so_restarts_and_backend_count() -> None:
    got = _ignored({"run": {"max_restarts": 1, "backend": "gloo", "num_workers": 3},
                    "comm": {"timeout_s": 30.0},
                    "tensor_parallel": {"tensor_parallel_size": 2}})
    assert set(got) == {"run.num_workers"}
    assert "tensor_parallel_size" in got["run.num_workers"]


# --------------------------------------------------------- [comm] outside DataParallel


@pytest.mark.parametrize("strategy", [{"type": "Local"}, MP, FED, PBT],
                         ids=["Local", "ModelParallel", "Federated", "PBT"])
def test_dataparallel_comm_fields_elsewhere(strategy: dict[str, Any]) -> None:
    got = _ignored({"strategy": strategy, "comm": {"bucket_size_mb": 4.0, "gossip_step": 0.5}})
    kind = strategy["type"]
    assert f"{kind} has no DataParallel gradient exchange" in got["comm.bucket_size_mb"]
    assert f"{kind} has no DataParallel gradient exchange" in got["comm.gossip_step"]


def test_a_replicated_stage_reads_the_bucket_size() -> None:
    """Its replicas sum their gradients through the one gradient sync, in buckets of
    comm.bucket_size_mb (gossip_step stays DataParallel's)."""
    stage = {"back": {**DP, "broadcast_buffers": False}}
    got = _ignored({"strategy": MP, "subgraphs": stage,
                    "comm": {"bucket_size_mb": 4.0, "gossip_step": 0.5}})
    assert set(got) == {"comm.gossip_step"}


def test_comm_timeout_is_read_by_every_launched_strategy() -> None:
    for strategy in (DP, MP, FED, PBT):
        assert "comm.timeout_s" not in _ignored({"strategy": strategy, "comm": {"timeout_s": 9.0}})


def test_dataparallel_reads_its_comm_fields_where_they_apply() -> None:
    assert _ignored({"strategy": DP, "comm": {"bucket_size_mb": 4.0}}) == {}
    choco = {**DP, "aggregation": {"method": "Decentralized", "topology": "ring"}}
    assert _ignored({"strategy": choco, "compression": {"method": "TopK", "k": 8},
                     "comm": {"gossip_step": 0.5}}) == {}
    got = _ignored({"strategy": choco, "comm": {"gossip_step": 0.5, "bucket_size_mb": 4.0}})
    assert "this job runs Decentralized" in got["comm.gossip_step"]
    assert "this job runs Decentralized" in got["comm.bucket_size_mb"]
    got = _ignored({"strategy": DP, "run": {"num_workers": 3}})
    assert "strategy.num_replicas" in got["run.num_workers"]


def test_process_count_is_read_where_it_is_free() -> None:
    for strategy in (MP, FED, PBT):
        assert "run.num_workers" not in _ignored({"strategy": strategy, "run": {"num_workers": 2}})


# ------------------------------------------------------- the TP probe with a [task]


def test_tp_probe_builds_the_model_of_a_task_job() -> None:
    job = load_job({**LM, "tensor_parallel": {"tensor_parallel_size": 2}})
    info = probe_tp(job)
    assert info is not None and info.attention and info.blocks >= 2


def test_memory_optimization_is_judged_for_a_language_model_task() -> None:
    # on the CPU, Extreme's offload does nothing: it checkpoints as High does
    got = _ignored({**LM, "run": {"device": "cpu"},
                    "tensor_parallel": {"tensor_parallel_size": 2, "memory_optimization": "Extreme"}})
    assert "High" in got["tensor_parallel.memory_optimization"]


def test_fusion_threshold_is_judged_for_a_task_factory_job() -> None:
    doc = {"task": {"factory": "user_task:make_task"},
           "tensor_parallel": {"tensor_parallel_size": 2, "fusion_threshold_bytes": 4096}}
    assert probe_tp(load_job(doc)) is not None
    assert "nothing to fuse" in _ignored(doc)["tensor_parallel.fusion_threshold_bytes"]


# ----------------------------------------------------------- through the CLI


def test_validate_prints_each_ignored_setting(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "local.toml"
    err = _validate(path, """
        [run]
        name = "p"
        max_restarts = 2
        num_workers = 2
        backend = "gloo"

        [[workers]]
        id = "a"

        [comm]
        timeout_s = 30.0
        bucket_size_mb = 8.0
    """, capsys)
    for name in ("run.max_restarts", "run.num_workers", "run.backend", "workers",
                 "comm.timeout_s", "comm.bucket_size_mb"):
        assert f"{path}: warning: {name} ignored: " in err, (name, err)
    # the tensor-parallel probe builds a language model task's GPT
    path = tmp_path / "lm.toml"
    err = _validate(path, """
        [run]
        device = "cpu"

        [task]
        name = "language_model"
        block_size = 16

        [data]
        factory = "test_tp_task:tiny_lm_data"

        [model]
        name = "gpt"
        n_layer = 2
        n_head = 2
        n_embd = 32

        [tensor_parallel]
        tensor_parallel_size = 2
        memory_optimization = "Extreme"
    """, capsys)
    assert f"{path}: warning: tensor_parallel.memory_optimization ignored: Extreme has the " \
           "same effect as High" in err, err
