"""A tiny HF ``LlamaForCausalLM`` (8 heads, 4 kv heads: grouped-query) on 4 gloo ranks, no
plan: logits and gradients equal the dense model's and torch's ``parallelize_module`` with
HF's ``base_model_tp_plan``; paratrain given that plan agrees too."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from _hf_checks import check_suite  # noqa: E402
from _workers_hf import hf_suite  # noqa: E402

from paratrain.comm.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow


def test_llama_4_ranks_parity_with_dense_and_torch() -> None:
    results: list[dict[str, Any]] = run_distributed(
        hf_suite, 4, "llama", {"heads": 8, "kv_heads": 4, "hidden": 32}, False, timeout_s=240)
    check_suite(results, full=False, plan=True)
    assert "8 heads -> 2, 4 kv heads -> 1 per rank" in dict(results[0]["sharding"])["model.layers.0.self_attn"]
