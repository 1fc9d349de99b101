"""timm 1.0.31's own ``vit_tiny_patch16_224`` (4 heads), ``Attention`` (fused ``qkv``) and
``Mlp`` under tensor parallel 2, imported in the ranks from ``.venv/timm`` (tests/_real_timm.py:
timm cannot sit in the venv beside transformers). paratrain recognises timm's classes by
module and name (``tensor_parallel/foreign.py``).

Against the dense model: outputs, gathered gradients and one SGD step; timm's ``Block``
calls ``attn(x, attn_mask=..., is_causal=...)`` (issue 36's ``TypeError``), per-head or
broadcast masks, fused and unfused attention. Against torch's ``parallelize_module``: the
``Mlp`` only, with the same plan. timm's attention is not compared with torch: torch's
``ColwiseParallel`` cuts ``qkv``'s output features into contiguous chunks (rank 0 would hold
all of q and half of k), and timm's forward reshapes to the full head count and width, so
torch's styles cannot express its head split without rewriting the module."""

from __future__ import annotations

from typing import Any

import pytest
from _hf_checks import close

from _real_timm import timm_dir
from paratrain.comm.testing import run_distributed

pytestmark = pytest.mark.slow
needs_timm = pytest.mark.skipif(timm_dir() is None, reason="timm is not installed in .venv/timm (make installs it)")

ATTN = "Attention: qkv packed colwise (q|k|v by heads), proj rowwise: 4 heads -> 2 per rank"


@pytest.fixture(scope="module")
def r2() -> list[dict[str, Any]]:
    from _workers_timm import vit_suite

    return run_distributed(vit_suite, 2, timeout_s=240)


@needs_timm
def test_the_blocks_are_timm_s_own(r2: list[dict[str, Any]]) -> None:
    assert r2[0]["types"] == ["timm.models.vision_transformer.Block", "timm.layers.attention.Attention",
                              "timm.layers.mlp.Mlp"]


@needs_timm
def test_vit_equals_the_dense_model(r2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(r2):
        close(res["auto"], f"rank {rank}: vit")
        close(res["qk_norm"], f"rank {rank}: vit with qk_norm")
        step = res["step"]
        assert step["state"] < 1e-5 and step["out"] < 1e-5, step
        assert step["moved"] > 1e-3, step  # the step changed the weights
    notes = dict(r2[0]["sharding"])
    assert notes["blocks.0.attn"] == notes["blocks.1.attn"] == ATTN
    assert notes["blocks.0.mlp"] == notes["blocks.1.mlp"] == "Mlp: fc1 colwise, fc2 rowwise"


@needs_timm
def test_a_plan_on_the_vit_s_children_with_the_rules_for_the_rest(r2: list[dict[str, Any]]) -> None:
    for res in r2:
        close(res["plan"], "vit with a plan")
    assert r2[0]["plan_layout"] == [
        ("blocks.0.attn", 'replicate (plan "blocks.0.attn")'),
        ("blocks.0.mlp.fc1", 'colwise, output replicated (plan "blocks.0.mlp.fc1")'),
        ("blocks.0.mlp.fc2", 'rowwise, input split here (plan "blocks.0.mlp.fc2")'),
        ("blocks.1.attn", ATTN),
        ("blocks.1.mlp", "Mlp: fc1 colwise, fc2 rowwise"),
        ("head", 'colwise, output replicated (plan "head")'),
    ]


@needs_timm
def test_packed_qkv_keeps_the_dense_names(r2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(r2):
        assert res["names"]["module.blocks.1.attn.qkv.v.weight"] == "blocks.1.attn.qkv.weight"
        assert res["shards"]["module.blocks.1.attn.qkv.v.weight"] == {"shape": [576, 192],
                                                                       "slices": [[0, 384 + 96 * rank, 96]]}
        assert res["pieces"] == 0.0  # reshard.take cuts exactly this rank's tensors out of the dense ones


@needs_timm
def test_timm_s_block_call_signature_is_honoured() -> None:
    from _workers_timm import block_call_suite

    for res in run_distributed(block_call_suite, 2, timeout_s=240):
        assert res.pop("moves") > 1e-3
        for call, diff in res.items():
            assert diff < 1e-5, (call, diff)


@needs_timm
def test_mlp_equals_torch_s_parallelize_module() -> None:
    from _workers_timm import mlp_vs_torch_suite

    for rank, res in enumerate(run_distributed(mlp_vs_torch_suite, 2, timeout_s=240)):
        assert res["type"] == "timm.layers.mlp"
        for k in ("ours", "torch", "ours_vs_torch"):
            close(res[k], f"rank {rank}: {k}")
        assert res["sharding"] == [("", "Mlp: fc1 colwise, fc2 rowwise")]  # the root


@needs_timm
def test_what_cannot_be_sharded_is_refused_by_name() -> None:
    from _workers_timm import refusals_suite

    res = run_distributed(refusals_suite, 2, timeout_s=240)[0]
    assert res["heads"].startswith("ConfigError: tensor_parallel.tensor_parallel_size: blocks.0.attn (Attention)")
    assert "num_heads 3 is not divisible by tensor_parallel_size 2" in res["heads"]
    assert "norm (LayerNorm) normalises the whole width" in res["scale_norm"]
    assert "submodules gate are not part of the known forward" in res["gated"]


def test_register_block_declares_a_class_of_yours() -> None:
    """``register_block``: a class of yours with timm ``Mlp``'s structure and forward is
    sharded as one (rank 0's dry-run construction, no processes, no timm)."""
    from torch import nn

    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import TPGroups
    from paratrain.config import TensorParallelismConfig
    from paratrain.tensor_parallel import TensorParallelModule
    from paratrain.tensor_parallel.foreign import register_block

    class MyMlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

        def forward(self, x: Any) -> Any:
            return self.fc2(self.act(self.fc1(x)))

    with pytest.raises(ValueError, match="unknown block kind 'mpl'"):
        register_block(MyMlp, "mpl")
    register_block(MyMlp, "mlp")
    comm = TPComm(None, [0, 1], rank=0, pattern="AllReduce")
    tpm = TensorParallelModule(MyMlp(), TensorParallelismConfig(tensor_parallel_size=2), TPGroups(comm, None, 2, 1, 0))
    assert tpm.sharding == [("", "MyMlp: fc1 colwise, fc2 rowwise")]
    assert tpm.module.fc1.weight.shape == (8, 8)
