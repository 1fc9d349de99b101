"""ZeRO for DataParallel over models written by others: a raw Hugging Face
``GPT2LMHeadModel`` (packed ``Conv1D`` projections, ``lm_head`` tied to the token
embedding) and ``LlamaForCausalLM`` (rotary embedding buffers, grouped-query attention)
from tiny configs (tests/hf_factories.py), 2 gloo replicas, their ``CausalLMOutput`` going
to the task as it is. ZeRO-2, ZeRO-3, and ZeRO-3 per decoder block (``shard_unit`` by the
blocks' class name, as FSDP2's ``fully_shard`` per block), gives unsharded AllReduce's
test loss and parameters (rtol 1e-6 after 3 AdamW steps with clipping), and the export is
the one model state_dict with the tie kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from test_mesh_pipeline_tp_hf import _job

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


def _dp(tmp: Path, name: str, model: str, shard: str, **extra: Any) -> dict[str, Any]:
    job = _job(tmp, name, f"hf_factories:{model}",
               strategy={"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"},
                         "shard": shard, **extra})
    job["train"]["optimizer"] = {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}
    return paratrain.fit(job)


@pytest.mark.parametrize("model", list(BLOCKS))
def test_each_zero_level_equals_unsharded_allreduce(tmp_path: Path, model: str) -> None:
    ref_run = _dp(tmp_path, "none", model, "none")
    ref = paratrain.load_model(ref_run["run_dir"])
    runs = {lvl: _dp(tmp_path, lvl, model, lvl) for lvl in ("gradients", "parameters")}
    runs["per-block"] = _dp(tmp_path, "per-block", model, "parameters", shard_unit=[BLOCKS[model]])
    for name, got in runs.items():
        assert got["test_loss"] == pytest.approx(ref_run["test_loss"], rel=1e-6), name
        out = paratrain.load_model(got["run_dir"])
        assert list(out) == list(ref), name
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-6, atol=1e-7, msg=f"{name}: {k}")
    units = runs["per-block"]["units"]  # non-vacuity: one unit per decoder block, the rest the root's
    assert sum(1 for u in units if u != "(root)") == 2 and "(root)" in units, units
    if model == "gpt2":  # the tie survives the shards: one tensor under both names
        out = paratrain.load_model(runs["per-block"]["run_dir"])
        assert torch.equal(out["lm_head.weight"], out["transformer.wte.weight"])
