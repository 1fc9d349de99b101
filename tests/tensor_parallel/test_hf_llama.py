"""Tensor parallelism on a tiny HF ``LlamaForCausalLM`` (4 heads, 2 kv heads, 2 layers) that
paratrain did not write, on 2 gloo ranks: its attention (q/k/v colwise by whole heads,
grouped-query kv heads split, o rowwise; rotary embeddings) and gate/up/down MLP are
recognised without a plan; logits and gradients equal the dense model's and those of torch's
``parallelize_module`` with HF's own ``base_model_tp_plan``, which paratrain's
``[tensor_parallel.plan]`` accepts as well. The errors run without processes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from _hf_checks import check_suite  # noqa: E402
from _workers_hf import LLAMA_PLAN, errors, hf_suite  # noqa: E402

from paratrain.comm.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def r2() -> list[dict[str, Any]]:
    return run_distributed(hf_suite, 2, "llama", {}, timeout_s=240)


def test_llama_parity_with_dense_and_torch_parallelize_module(r2: list[dict[str, Any]]) -> None:
    check_suite(r2, plan=True)


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
