"""What tensor parallelism refuses on HF models, as rank 0's dry run does (no processes): kv
heads not divisible by the size, a subclass that overrides a recognised forward (unless the
plan keeps it whole), plan patterns that match nothing or a style on a module it cannot take."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from _workers_hf import LLAMA_PLAN, errors  # noqa: E402


def test_kv_heads_not_divisible_is_a_clear_error() -> None:
    msg = errors("llama", 4)
    assert msg.startswith("tensor_parallel.tensor_parallel_size: model.layers.0.self_attn (LlamaAttention)")
    assert "num_key_value_heads 2 is not divisible by tensor_parallel_size 4" in msg


def test_plan_errors_name_the_key() -> None:
    msg = errors("llama", 2, plan={**LLAMA_PLAN, "model.layers.*.mlp.nothing": "colwise"})
    assert msg.startswith('tensor_parallel.plan."model.layers.*.mlp.nothing": matches no module')
    msg = errors("llama", 2, plan={"model.embed_tokens": "colwise"})
    assert 'tensor_parallel.plan."model.embed_tokens"' in msg and "plain nn.Linear" in msg


def _scaled_attention() -> type:
    from transformers.models.llama.modeling_llama import LlamaAttention

    class Scaled(LlamaAttention):
        """A LlamaAttention that changes its forward: not provably the same when sharded."""

        def forward(self, *a: Any, **k: Any) -> Any:
            out, w = super().forward(*a, **k)
            return 2 * out, w

    Scaled.__qualname__ = "Scaled"
    return Scaled


def test_a_subclass_with_its_own_forward_is_refused() -> None:
    from _workers_hf import llama

    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import TPGroups
    from paratrain.config import ConfigError, TensorParallelismConfig
    from paratrain.tensor_parallel import TensorParallelModule

    def model() -> Any:
        m = llama()
        m.model.layers[0].self_attn.__class__ = _scaled_attention()
        return m

    comm = TPComm(None, [0, 1], rank=0, pattern="AllReduce")
    cfg = TensorParallelismConfig(tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn \(Scaled\) is a LlamaAttention whose "
                                          "forward is overridden"):
        TensorParallelModule(model(), cfg, TPGroups(comm, None, 2, 1, 0))
    # "replicate" keeps it whole; the rest is still sharded
    cfg = TensorParallelismConfig.model_validate(
        {"tensor_parallel_size": 2, "plan": {"model.layers.0.self_attn": "replicate"}})
    notes = dict(TensorParallelModule(model(), cfg, TPGroups(comm, None, 2, 1, 0)).sharding)
    assert notes["model.layers.0.self_attn"] == 'replicate (plan "model.layers.0.self_attn")'
    assert "model.layers.1.self_attn" in notes
