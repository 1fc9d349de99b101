"""Sequence parallelism through ``[tensor_parallel.plan]`` on a tiny HF ``LlamaForCausalLM``
(2 gloo ranks): the norms run on sequence shards (``sequence``), the attention and MLP
gather their input (``prepare_input``), their output projections reduce-scatter
(``rowwise``, ``output = "sequence"``) and the head gathers the shards
(``colwise``, ``input = "sequence"``). Logits and every gradient equal the dense model's
(rtol 1e-5) for even and uneven shards, with and without recomputation; the norms'
gradients are partial sums until they are summed over the ranks (non-vacuity); a plan that
lets sequence shards reach an attention block stops, naming the module."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from _hf_checks import TOL  # noqa: E402
from _workers_hf_seq import sequence_suite  # noqa: E402

from paratrain.comm.testing import run_distributed  # noqa: E402
from paratrain.config import ConfigError, TensorParallelismConfig  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def r2() -> list[dict[str, Any]]:
    return run_distributed(sequence_suite, 2, timeout_s=240)


@pytest.mark.parametrize("seq", [8, 7])
def test_sequence_parallel_llama_equals_dense(r2: list[dict[str, Any]], seq: int) -> None:
    for rank, res in enumerate(r2):
        for key in (f"ours_{seq}", f"checkpointed_{seq}"):
            d = res[key]
            assert not d["missing"], (rank, key, d)
            assert d["out"] < TOL and d["grads"] < TOL, (rank, key, d)
        # non-vacuity: each rank's norm gradients cover its tokens only before the sum
        assert res[f"unsummed_{seq}"] > 1e-3, (rank, res[f"unsummed_{seq}"])


def test_sequence_parallel_matches_torch_parallelize_module(r2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(r2):
        d = res["torch"]
        assert isinstance(d, dict), d  # torch's SequenceParallel on HF Llama
        assert d["out"] < TOL and d["grads"] < TOL, (rank, d)


def test_the_layout_is_explained_and_norms_are_summed(r2: list[dict[str, Any]]) -> None:
    notes = dict(r2[0]["sharding"])
    assert notes["model.layers.0"].startswith("prepare_input (replicate -> sequence)")
    assert notes["model.layers.1.self_attn"].startswith("prepare_input (sequence -> replicate)")
    assert notes["model.norm"].startswith("sequence")
    assert "reduce-scattered" in notes["model.layers.0.mlp.down_proj"]
    assert "input sequence-gathered" in notes["lm_head"] and "output replicated" in notes["lm_head"]
    assert r2[0]["sp_params"] == sorted(
        [f"module.model.layers.{i}.{n}.weight" for i in (0, 1)
         for n in ("input_layernorm", "post_attention_layernorm")] + ["module.model.norm.weight"])


def test_sequence_shards_reaching_attention_are_refused(r2: list[dict[str, Any]]) -> None:
    msg = r2[0]["wrong"]
    assert "model.layers.0.self_attn.q_proj" in msg and "receives sequence shards" in msg, msg
    assert "prepare_input" in msg


@pytest.mark.parametrize("entry, field", [
    ({"style": "prepare_input", "input": "replicate"}, "desired_input"),
    ({"style": "prepare_input", "input": "shard", "desired_input": "replicate"}, "input"),
    ({"style": "sequence", "output": "shard"}, "sequence"),
    ({"style": "rowwise", "input": "sequence"}, "rowwise"),
    ({"style": "colwise", "output": "sequence"}, "colwise"),
    ({"style": "colwise", "desired_input": "sequence"}, "desired_input"),
])
def test_bad_sequence_entries_are_config_errors(entry: dict[str, Any], field: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as e:
        TensorParallelismConfig.model_validate({"tensor_parallel_size": 2, "plan": {"model.norm": entry}})
    assert field in str(e.value)


def test_sequence_entries_round_trip() -> None:
    cfg = TensorParallelismConfig.model_validate({"tensor_parallel_size": 2, "plan": {
        "a": "sequence", "b": {"style": "prepare_input", "input": "sequence", "desired_input": "replicate"},
        "c": {"style": "colwise", "input": "sequence", "output": "replicate"}}})
    again = TensorParallelismConfig.model_validate_json(cfg.model_dump_json())
    assert again == cfg
    assert again.plan["b"].desired_input == "replicate"
