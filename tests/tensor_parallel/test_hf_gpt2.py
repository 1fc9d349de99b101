"""Tensor parallelism on a tiny HF ``GPT2LMHeadModel`` (Conv1D layers, weights stored
``[in, out]``; a packed ``c_attn`` = ``[q | k | v]``) on 2 gloo ranks, no plan: c_attn is cut
part by part (each rank computes the packed q|k|v of its own heads), c_proj rowwise, the MLP
c_fc/c_proj colwise/rowwise. Logits and gradients equal the dense model's and torch's
``parallelize_module`` (which takes nn.Linear only: the reference turns each Conv1D into its
Linear and orders c_attn's rows by rank, see ``_workers_hf._torch_reference``)."""

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
    return run_distributed(hf_suite, 2, "gpt2", {}, timeout_s=240)


def test_gpt2_parity_with_dense_and_torch_parallelize_module(r2: list[dict[str, Any]]) -> None:
    check_suite(r2)


def test_gpt2_packed_qkv_checkpoint_names_and_shards(r2: list[dict[str, Any]]) -> None:
    notes = dict(r2[0]["sharding"])
    assert notes["transformer.h.0.attn"].startswith("GPT2Attention: c_attn packed colwise")
    assert notes["transformer.h.1.mlp"] == "GPT2MLP: c_fc colwise, c_proj rowwise (Conv1D)"
    for rank, res in enumerate(r2):
        # rank r's k part: columns [32 + 16 r, 32 + 16 r + 16) of the dense [32, 96] c_attn.weight
        spec = res["shards"]["module.transformer.h.0.attn.c_attn.k.weight"]
        assert spec == {"shape": [32, 96], "slices": [[1, 32 + 16 * rank, 16]]}
        assert res["shards"]["module.transformer.h.0.attn.c_proj.weight"] == {
            "shape": [32, 32], "slices": [[0, 16 * rank, 16]]}


def test_non_vacuity_contiguous_cut_of_packed_qkv_is_detected(r2: list[dict[str, Any]]) -> None:
    # c_attn cut into contiguous chunks (rank 0: all of q, half of k) with the local
    # split_size: it runs, and is wrong
    assert all(res["wrong"] > 1e-2 for res in r2)
