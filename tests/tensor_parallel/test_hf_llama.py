"""Tensor parallelism on a tiny HF ``LlamaForCausalLM`` (4 heads, 2 kv heads, 2 layers) that
paratrain did not write, on 2 gloo ranks: its attention (q/k/v colwise by whole heads,
grouped-query kv heads split, o rowwise; rotary embeddings) and gate/up/down MLP are
recognised without a plan; logits and gradients equal the dense model's and those of torch's
``parallelize_module`` with HF's own ``base_model_tp_plan``, which paratrain's
``[tensor_parallel.plan]`` accepts as well (the errors: test_hf_errors.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from _hf_checks import check_suite  # noqa: E402
from _workers_hf import hf_suite  # noqa: E402

from paratrain.comm.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def r2() -> list[dict[str, Any]]:
    return run_distributed(hf_suite, 2, "llama", {}, timeout_s=240)


def test_llama_parity_with_dense_and_torch_parallelize_module(r2: list[dict[str, Any]]) -> None:
    check_suite(r2, plan=True)


def test_mistral_sliding_window_attention_parity(r2: list[dict[str, Any]]) -> None:
    from _hf_checks import close

    for res in r2:
        close(res["mistral"], "mistral vs dense")


def test_llama_blocks_are_recognised_and_explained(r2: list[dict[str, Any]]) -> None:
    notes = dict(r2[0]["sharding"])
    assert set(notes) == {f"model.layers.{i}.{b}" for i in (0, 1) for b in ("self_attn", "mlp")}
    assert "4 heads -> 2, 2 kv heads -> 1 per rank" in notes["model.layers.0.self_attn"]
    assert notes["model.layers.1.mlp"].startswith("LlamaMLP: gate_proj/up_proj colwise, down_proj rowwise")
    # checkpoints keep the model's names: a q shard is rows [r*16, r*16+16) of q_proj.weight
    for rank, res in enumerate(r2):
        spec = res["shards"]["module.model.layers.0.self_attn.k_proj.weight"]
        assert spec == {"shape": [16, 32], "slices": [[0, 8 * rank, 8]]}


def test_non_vacuity_kv_heads_left_whole_is_detected(r2: list[dict[str, Any]]) -> None:
    # the same plan without k_proj/v_proj: the query heads split, the kv heads whole
    for res in r2:
        wrong = res["wrong"]
        assert isinstance(wrong, str) or wrong > 1e-2, wrong
