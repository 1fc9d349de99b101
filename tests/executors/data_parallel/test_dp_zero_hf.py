"""ZeRO for DataParallel over models written by others: a raw Hugging Face
``GPT2LMHeadModel`` (packed ``Conv1D`` projections, ``lm_head`` tied to the token
embedding) and ``LlamaForCausalLM`` (rotary embedding buffers, grouped-query attention)
from tiny configs (tests/hf_factories.py), 2 gloo replicas (one launch for every case),
their ``CausalLMOutput`` going to the task as it is. ZeRO-2, ZeRO-3, and ZeRO-3 per decoder
block (``shard_unit`` by the blocks' class name, as FSDP2's ``fully_shard`` per block) give
unsharded AllReduce's test loss and parameters (rtol 1e-6 after 3 AdamW steps with
clipping), and the export is the one model state_dict with the tie kept; ZeRO-3 composed with
2-way tensor parallelism (dp 2 x tp 2) equals the Local run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_mesh_pipeline_tp_hf import _job

import paratrain
from _workers_dp_zero import zero_cases
from paratrain.comm.testing import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
LEVELS = ("none", "gradients", "parameters", "per-block")


def _extra(model: str, level: str) -> dict[str, Any]:
    return {"task": {"name": "language_model", "block_size": 16},
            "data": {"factory": "hf_factories:tiny_text"},
            "model": {"factory": f"hf_factories:{model}", "hidden": 32},
            "train": {"eval_every": 3, "grad_clip_norm": 0.5},
            **({"strategy_extra": {"shard_unit": [BLOCKS[model]]}} if level == "per-block" else {})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("zero_hf")
    cases = [(f"{m}-{lvl}", "parameters" if lvl == "per-block" else lvl, "adamw", _extra(m, lvl))
             for m in BLOCKS for lvl in LEVELS]
    return tmp, run_distributed(zero_cases, 2, str(tmp), cases, timeout_s=350)


@pytest.mark.parametrize("model", list(BLOCKS))
def test_each_zero_level_equals_unsharded_allreduce(runs: tuple[Path, list[dict[str, Any]]],
                                                    model: str) -> None:
    tmp, ranks = runs
    for r in ranks:
        ref = torch.tensor(r[f"{model}-none"]["params"], dtype=torch.float64)
        for lvl in LEVELS[1:]:
            got = r[f"{model}-{lvl}"]
            if "test_loss" in got["summary"]:  # the evaluating rank's
                assert got["summary"]["test_loss"] == pytest.approx(
                    r[f"{model}-none"]["summary"]["test_loss"], rel=1e-6), lvl
            torch.testing.assert_close(torch.tensor(got["params"], dtype=torch.float64), ref,
                                       rtol=1e-6, atol=1e-7, msg=lvl)
    assert "test_loss" in ranks[0][f"{model}-parameters"]["summary"]
    units = ranks[0][f"{model}-per-block"]["summary"]["units"]  # non-vacuity: a unit per block
    assert sum(1 for u in units if u != "(root)") == 2 and "(root)" in units, units
    ref_sd = paratrain.load_model(tmp / f"{model}-none-2")
    out = paratrain.load_model(tmp / f"{model}-per-block-2")  # the export: one whole state_dict
    assert list(out) == list(ref_sd)
    if model == "gpt2":  # the tie survives the shards: one tensor under both names
        assert torch.equal(out["lm_head.weight"], out["transformer.wte.weight"])


@pytest.mark.parametrize("model", list(BLOCKS))
def test_zero3_by_tensor_parallel_equals_the_local_run(tmp_path: Path, model: str) -> None:
    """ZeRO-3 x 2-way tensor parallelism on one mesh (4 processes, dp 2 x tp 2) over the
    same models: 2 replicas of 8 rows equal Local on 16 (rtol 1e-5, SGD with momentum)."""
    factory = f"hf_factories:{model}"
    local_doc = _job(tmp_path, "local", factory)
    local_doc["train"]["batch_size"] = 16
    local = paratrain.fit(local_doc)
    got = paratrain.fit(_job(tmp_path, "zero3_tp", factory, tensor_parallel={"tensor_parallel_size": 2},
                             strategy={"type": "DataParallel", "num_replicas": 2,
                                       "aggregation": {"method": "AllReduce"}, "shard": "parameters"}))
    assert got["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    ref, out = paratrain.load_model(local["run_dir"]), paratrain.load_model(got["run_dir"])
    assert list(out) == list(ref)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
