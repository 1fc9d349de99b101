"""models/state.py: a tied weight is one entry of the unique state, and loading such a
state fills every alias (the federated global model relies on it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.models.state import load_unique_state_dict, unique_state_dict


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(3)


def test_tied_weight_is_one_entry_and_loading_fills_both_names() -> None:
    torch.manual_seed(0)
    m = Tied()
    full = m.state_dict()
    assert "head.weight" in full and "embed.weight" in full
    u = unique_state_dict(m)
    assert "embed.weight" in u and "head.weight" not in u
    assert set(u) == set(full) - {"head.weight"}
    new = {k: torch.full_like(v, 0.5) for k, v in u.items()}
    load_unique_state_dict(m, new)
    assert torch.equal(m.head.weight, torch.full((5, 3), 0.5))
    assert m.head.weight is m.embed.weight  # still tied
    with pytest.raises(KeyError, match="missing"):
        load_unique_state_dict(m, {k: v for k, v in new.items() if k != "norm.bias"})


def test_untied_models_keep_every_entry() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert list(unique_state_dict(m)) == list(m.state_dict())


def test_the_gpt_zoo_model_ties_its_head() -> None:
    from paratrain.config import load_job
    from paratrain.task import resolve_task

    job = load_job({"task": {"name": "language_model", "block_size": 8}, "data": {"name": "shakespeare"},
                    "model": {"name": "gpt", "n_layer": 1, "n_head": 1, "n_embd": 8}})
    task = resolve_task(job)
    train, _ = task.datasets(0)
    model = task.build_model(job.model, train)
    assert len(unique_state_dict(model)) == len(model.state_dict()) - 1
