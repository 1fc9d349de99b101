"""A raw HF ``LlamaForCausalLM`` (no wrapper, no plan) trains under ``[tensor_parallel]
tensor_parallel_size = 2`` with the built-in ``language_model`` task: after 4 SGD steps its
parameters and test loss equal the Local run's on the same batches (rtol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _hf_train import tp_equals_local  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_llama_trains_under_tensor_parallel_2_as_local(tmp_path: Path) -> None:
    tp_equals_local(tmp_path, {"factory": "hf_factories:llama"}, 2)


def test_llama_trains_with_sequence_parallelism_as_local(tmp_path: Path) -> None:
    """torchtitan's sequence-parallel plan (test_hf_sequence.py) through the TP engine: the
    norms' gradients are summed every step, so 4 steps end at the Local run's parameters."""
    from _workers_hf_seq import SP_PLAN

    tp_equals_local(tmp_path, {"factory": "hf_factories:llama"}, 2, plan=SP_PLAN)
