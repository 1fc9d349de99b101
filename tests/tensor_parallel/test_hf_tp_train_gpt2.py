"""A raw HF ``GPT2LMHeadModel`` (Conv1D layers, packed c_attn, tied head; no wrapper, no
plan) trains under ``tensor_parallel_size = 2`` with the built-in ``language_model`` task:
after 4 SGD steps its parameters (the tied head saved under both names) and test loss equal
the Local run's on the same batches (rtol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _hf_train import tp_equals_local  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_gpt2_trains_under_tensor_parallel_2_as_local(tmp_path: Path) -> None:
    tp_equals_local(tmp_path, {"factory": "hf_factories:gpt2", "heads": 4}, 2)
