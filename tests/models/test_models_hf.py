"""The ``hf`` zoo model: a raw transformers causal LM built from its config (no download),
trained under the built-in language_model task with no wrapper, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.config import ConfigError
from paratrain.models.zoo import hf_causal_lm

transformers = pytest.importorskip("transformers")

LLAMA = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_builds_the_raw_transformers_model_with_the_data_vocabulary() -> None:
    torch.manual_seed(0)
    m = hf_causal_lm((16,), 65, **LLAMA)
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.vocab_size == 65
    out = m(torch.randint(0, 65, (2, 16)))
    assert out.logits.shape == (2, 16, 65)
    g = hf_causal_lm((16,), 65, architecture="gpt2", n_embd=32, n_layer=1, n_head=2)
    # GPT-2's 50256 token ids mean nothing in a 65-token vocabulary: unset, not out of range
    assert g.config.bos_token_id is None and g.config.eos_token_id is None
    assert g.lm_head.weight is g.transformer.wte.weight  # its tie kept


@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "model.architecture"),
    ({"architecture": "no_such_model"}, "model.architecture"),
    ({"architecture": "gpt2", "vocab_size": 10}, "model.vocab_size"),
    ({"architecture": "gpt2", "n_positions": 8}, "model.max_position_embeddings"),
    ({"architecture": "llama", "bos_token_id": 99}, "model.bos_token_id"),
])
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        hf_causal_lm((16,), 65, **kwargs)
    assert field in str(e.value)


def test_trains_under_the_language_model_task_and_beats_its_start(tmp_path: Path) -> None:
    # strided blocks: evaluations read 1,042 test blocks, not 33,328
    job = {"run": {"name": "hf", "seed": 0, "output_dir": str(tmp_path)},
           "task": {"name": "language_model", "block_size": 16, "stride": 512},
           "model": {"name": "hf", **LLAMA}, "data": {"name": "shakespeare"},
           "train": {"epochs": 1, "max_steps": 20, "batch_size": 16, "eval_every": 10,
                     "optimizer": {"name": "adamw", "lr": 3e-3}}}
    summary = paratrain.fit(job)
    # ln(65) = 4.17 nats is a uniform guess; 20 steps of AdamW must be well below it
    assert summary["test_loss"] < 3.6
    # the trained model comes back under transformers' own names, loadable into a fresh one
    state = paratrain.load_model(tmp_path / "hf")
    vocab = state["model.embed_tokens.weight"].shape[0]
    fresh = hf_causal_lm((16,), vocab, **LLAMA)
    fresh.load_state_dict(state, strict=True)
    assert summary["num_parameters"] == sum(p.numel() for p in fresh.parameters())
