"""Issue 21 acceptance: raw Hugging Face models (``GPT2LMHeadModel``, ``LlamaForCausalLM``,
tiny configs built by ``[model] factory``, tests/hf_factories.py; no wrapper, no download)
train under the built-in ``language_model`` task: Local (their ``CausalLMOutput`` read by
``.logits``; or dict batches with labels and the model's own loss), DataParallel with the
parameters of the Local run on the same global batch, Federated and PopulationBased with
the test loss falling."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from paratrain.training import read_metrics

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600)]

VOCAB = 77  # the shakespeare character vocabulary (hf_factories.tiny_text)
FACTORIES = {"gpt2": "hf_factories:gpt2", "llama": "hf_factories:llama"}


def _job(tmp_path: Path, name: str, model: str, **extra: Any) -> dict[str, Any]:
    """A tiny language-model job over ``model``; ``train`` replaces keys of the default
    ``[train]``, a key given as None is left out."""
    train = {"batch_size": 8, "max_steps": 12, "eval_every": 6,
             "optimizer": {"name": "adam", "lr": 3e-3}, **extra.pop("train", {})}
    train = {k: v for k, v in train.items() if v is not None}
    return {"run": {"name": name, "seed": 1, "output_dir": str(tmp_path)},
            "task": {"name": "language_model", "block_size": 16},
            "data": {"factory": "hf_factories:tiny_text", **extra.pop("data", {})},
            "model": {"factory": FACTORIES[model]}, "train": train, **extra}


def _test_losses(run_dir: str) -> list[float]:
    return [float(r["test_loss"]) for r in read_metrics(run_dir) if r.get("test_loss") is not None]


@pytest.mark.parametrize("model", list(FACTORIES))
def test_a_raw_hf_model_trains_under_the_language_model_task(tmp_path: Path, model: str) -> None:
    summary = paratrain.fit(_job(tmp_path, model, model))
    losses = _test_losses(summary["run_dir"])
    assert len(losses) == 2 and losses[-1] < losses[0] < math.log(VOCAB) + 0.1, losses
    assert summary["test_loss"] < math.log(VOCAB) - 0.5
    state = paratrain.load_model(summary["run_dir"])
    assert any(k.endswith("embed_tokens.weight") or k.endswith("wte.weight") for k in state)


def test_dict_batches_use_the_models_own_loss(tmp_path: Path) -> None:
    """``{"input_ids", "labels"}`` items: ``model(**batch)``, the model's shifted loss."""
    summary = paratrain.fit(_job(tmp_path, "dicts", "gpt2", data={"dicts": True}))
    losses = _test_losses(summary["run_dir"])
    assert losses[-1] < losses[0] < math.log(VOCAB) + 0.1, losses


DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
SGD = {"max_steps": 6, "eval_every": 0, "optimizer": {"name": "sgd", "lr": 0.5}}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FACTORIES))
def test_data_parallel_matches_local_on_the_same_global_batch(tmp_path: Path, model: str) -> None:
    local = paratrain.fit(_job(tmp_path, "local", model, train={**SGD, "batch_size": 16}))
    dp = paratrain.fit(_job(tmp_path, "dp", model, train={**SGD, "batch_size": 8}, strategy=DP))
    ref, got = paratrain.load_model(local["run_dir"]), paratrain.load_model(dp["run_dir"])
    assert list(ref) == list(got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert dp["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    assert local["test_loss"] < math.log(VOCAB) - 0.3
