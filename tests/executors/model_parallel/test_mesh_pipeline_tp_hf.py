"""Pipeline x tensor parallelism over models written by others: a raw Hugging Face
``LlamaForCausalLM`` (grouped-query attention, gated MLP) and ``GPT2LMHeadModel`` (packed
``c_attn`` Conv1D, tied head), built from tiny configs (tests/hf_factories.py), as 2
pipeline stages x 2-way TP on 4 gloo processes (rank = stage*2 + tp).

transformers' forward cannot be traced by torch.fx, so each rank captures its sharded model
with torch.export, the tensor-parallel layers kept whole as ``call_module`` nodes
(paratrain.graph.trace.export_graph), and cuts it at the decoder layers the job names. Against
the unpartitioned Local run on the same batches, with clipping active (one global norm over
all 4 processes): the same test loss and parameters (rtol 1e-5); non-vacuity: the stages
really hold tensor-parallel shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORKERS = [{"id": "worker-0"}, {"id": "worker-1"}]
MODELS = {
    "llama": ("hf_factories:llama", ["model.layers.1", "model.norm", "lm_head"]),
    "gpt2": ("hf_factories:gpt2", ["transformer.h.1", "transformer.ln_f", "lm_head"]),
}


def _job(tmp: Path, name: str, factory: str, **extra: Any) -> dict[str, Any]:
    return {"run": {"name": name, "seed": 2, "output_dir": str(tmp)},
            "task": {"name": "language_model", "block_size": 16},
            "data": {"factory": "hf_factories:tiny_text"},
            "model": {"factory": factory, "hidden": 32},
            "train": {"batch_size": 8, "max_steps": 3, "eval_every": 3, "grad_clip_norm": 0.5,
                      "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9}},
            **extra}


_LOCAL: dict[str, dict[str, Any]] = {}


def local_run(tmp_path_factory: pytest.TempPathFactory, factory: str) -> dict[str, Any]:
    """The unpartitioned Local run of ``_job(..., factory)``'s summary, run once per process:
    this file and test_mesh_pipeline_zero_hf.py compare against the same run."""
    if factory not in _LOCAL:
        _LOCAL[factory] = paratrain.fit(_job(tmp_path_factory.mktemp("local"), "local", factory))
    return _LOCAL[factory]


@pytest.mark.parametrize("model", list(MODELS))
def test_hf_pipeline_x_tp_equals_the_local_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, model: str) -> None:
    factory, stage2 = MODELS[model]
    local = local_run(tmp_path_factory, factory)
    strategy = {"type": "ModelParallel",
                "communication": {"protocol": "Pipeline", "micro_batch_size": 2, "schedule": "1F1B"},
                "partitions": [{"node_ids": stage2, "target": {"WorkerId": "worker-1"}}]}
    got = paratrain.fit(_job(tmp_path, "pp_tp", factory, strategy=strategy, workers=WORKERS,
                             tensor_parallel={"tensor_parallel_size": 2}))
    assert got["tensor_parallel_size"] == 2 and got["tensor_parallel_shards_per_stage"] > 0
    assert got["mesh"]["layout"] == "rank = pp*2 + tp"
    assert got["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    ref, out = paratrain.load_model(local["run_dir"]), paratrain.load_model(got["run_dir"])
    assert list(out) == list(ref)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
