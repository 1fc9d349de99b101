"""ZeRO-3 inside a replicated pipeline stage over models written by others: a raw Hugging
Face ``LlamaForCausalLM`` (untied ``lm_head``) and ``GPT2LMHeadModel`` (``lm_head`` tied to
the token embedding, which the first stage holds and sends) from tiny configs
(tests/hf_factories.py), captured with torch.export, as a 2-stage 1F1B pipeline whose last
stage (``lm_head`` and the loss) is replicated on 2 workers with ``shard = "parameters"``
(3 gloo processes). Against the unpartitioned Local run on the same batches, clipping
active: the same test loss and parameters (rtol 1e-5). Llama's replicas each hold half of
``lm_head``'s rows between steps; GPT-2's replicated stage owns no parameter (the tied
weight stays with the embedding's stage), which ZeRO-3 must take in its stride."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mesh_pipeline_tp_hf import _job, local_run

import paratrain

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORKERS = [{"id": "worker-0"}, {"id": "worker-1"}, {"id": "worker-2"}]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_pipeline_with_a_zero3_stage_equals_the_local_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, model: str) -> None:
    factory = f"hf_factories:{model}"
    local = local_run(tmp_path_factory, factory)  # shared with test_mesh_pipeline_tp_hf.py
    strategy = {"type": "ModelParallel",
                "communication": {"protocol": "Pipeline", "micro_batch_size": 2, "schedule": "1F1B"},
                "partitions": [{"node_ids": ["lm_head"], "target": {"WorkerId": "worker-1"}}]}
    subgraphs = {"lm_head": {"type": "DataParallel", "num_replicas": 2,
                             "aggregation": {"method": "AllReduce"}, "shard": "parameters"}}
    got = paratrain.fit(_job(tmp_path, "pp_zero3", factory, strategy=strategy, workers=WORKERS,
                             subgraphs=subgraphs))
    assert got["stages"][1]["replicas"] == ["worker-1", "worker-2"]
    assert got["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    ref, out = paratrain.load_model(local["run_dir"]), paratrain.load_model(got["run_dir"])
    assert list(out) == list(ref)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    held = [s["held_bytes_measured"]["parameters"] for s in got["stage_stats"]]
    if model == "llama":  # lm_head: each replica holds ceil(vocabulary / 2) of its 32-float rows
        rows, cols = ref["lm_head.weight"].shape
        assert held[1] == held[2] == -(-rows // 2) * cols * 4 < rows * cols * 4
    else:  # tied: the head's weight is the embedding's, held (whole) by the first stage
        assert held[1] == held[2] == 0 and held[0] > 0
