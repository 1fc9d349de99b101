"""Issue 21 acceptance: raw Hugging Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (tiny
configs, tests/hf_factories.py) under Federated (2 clients, FedAvg) and PopulationBased (2
members) with the built-in ``language_model`` task: the test loss falls."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_hf_models import FACTORIES, VOCAB, _job, _test_losses

import paratrain
from test_api_fit import FEDERATED  # 2 clients, 2 FedAvg rounds, iid

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PBT = {"strategy": {"type": "PopulationBased", "population_size": 2, "generations": 2,
                    "exploit": {"method": "Truncation", "fraction": 0.5},
                    "explore": {"method": "Perturbation", "factor": 0.2}},
       "population": {"steps_per_generation": 8, "metric": "loss", "mode": "min"},
       "search_space": {"lr": {"type": "log_uniform", "low": 0.002, "high": 0.01}}}


@pytest.mark.parametrize("kind", ["Federated", "PopulationBased"])
@pytest.mark.parametrize("model", list(FACTORIES))
def test_federated_and_pbt_train_a_raw_hf_model(tmp_path: Path, model: str, kind: str) -> None:
    doc = FEDERATED if kind == "Federated" else PBT
    train = ({"batch_size": None, "max_steps": None, "eval_every": None} if kind == "Federated"
             else {"max_steps": None, "eval_every": None})  # what each budgets its own way
    summary = paratrain.fit(_job(tmp_path, kind, model, train=train, **doc))
    assert summary["test_loss"] < math.log(VOCAB) - 0.3, summary
    if kind == "Federated":
        losses = _test_losses(summary["run_dir"])
        assert len(losses) == 2 and losses[-1] < losses[0], losses
