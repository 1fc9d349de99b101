"""timm's fused-``qkv`` ``Attention`` and ``Mlp`` under tensor parallel 2. timm cannot be
installed beside this project's other libraries (it imports torchvision, whose PyPI wheel does
not import next to the CPU torch, and once torchvision is installed transformers imports it
and fails too), so the test uses a faithful copy of timm 1.0.31's classes
(``_workers_hf.Attention`` / ``Mlp``, and ``Block``'s call ``attn(x, attn_mask=...,
is_causal=...)``) registered as those blocks with ``register_block``; paratrain recognises
timm's own classes by their names. Per-head q/k norms are replicated and their gradients summed."""

from __future__ import annotations

from typing import Any

import pytest
from _hf_checks import close
from _workers_hf import vit_suite

from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def r2() -> list[dict[str, Any]]:
    return run_distributed(vit_suite, 2, timeout_s=240)


def test_timm_s_block_call_signature_is_honoured_under_tp2() -> None:
    """timm 1.0.31's ``Block`` calls ``self.attn(x, attn_mask=..., is_causal=...)``: issue 36's
    ``TypeError: ParallelFusedQKVAttention.forward() got an unexpected keyword argument``."""
    from _workers_hf import timm_call_suite

    for res in run_distributed(timm_call_suite, 2, timeout_s=240):
        assert res.pop("moves") > 1e-3
        for call, diff in res.items():
            assert diff < 1e-5, (call, diff)


def test_vit_blocks_parity_with_dense(r2: list[dict[str, Any]]) -> None:
    for res in r2:
        close(res["auto"], "vit")
    notes = dict(r2[0]["sharding"])
    assert notes["1.attn"] == "Attention: qkv packed colwise (q|k|v by heads), proj rowwise: 4 heads -> 2 per rank"
    assert notes["2.mlp"] == "Mlp: fc1 colwise, fc2 rowwise"


def test_a_plan_on_sequential_children_with_the_rules_for_the_rest(r2: list[dict[str, Any]]) -> None:
    for res in r2:
        close(res["plan"], "vit with a plan")
    assert r2[0]["plan_layout"] == [
        ("0", 'colwise, output replicated (plan "0")'),
        ("1", 'replicate (plan "1")'),
        ("2.attn", "Attention: qkv packed colwise (q|k|v by heads), proj rowwise: 4 heads -> 2 per rank"),
        ("2.mlp", "Mlp: fc1 colwise, fc2 rowwise"),
        ("4", 'rowwise, input split here (plan "4")'),
    ]


def test_packed_qkv_keeps_the_dense_names(r2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(r2):
        assert res["names"]["module.1.attn.qkv.v.weight"] == "1.attn.qkv.weight"
        assert res["shards"]["module.1.attn.qkv.v.weight"] == {"shape": [96, 32],
                                                                "slices": [[0, 64 + 16 * rank, 16]]}
        assert "module.1.attn.q_norm.weight" not in res["shards"]  # replicated, whole
        assert res["pieces"] == 0.0  # reshard.take cuts exactly this rank's tensors out of the dense ones


def test_whole_width_norm_in_attention_is_refused() -> None:
    from _workers_hf import Attention
    from torch import nn

    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import TPGroups
    from paratrain.config import ConfigError, TensorParallelismConfig
    from paratrain.tensor_parallel import TensorParallelModule

    attn = Attention(32, 4)
    attn.norm = nn.LayerNorm(32)  # timm's scale_norm: normalises all heads together
    comm = TPComm(None, [0, 1], rank=0, pattern="AllReduce")
    with pytest.raises(ConfigError, match=r"<root> \(Attention\): cannot be sharded .* norm \(LayerNorm\)"):
        TensorParallelModule(attn, TensorParallelismConfig(tensor_parallel_size=2), TPGroups(comm, None, 2, 1, 0))
