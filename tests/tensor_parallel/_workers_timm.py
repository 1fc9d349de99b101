"""Rank functions for test_timm_real.py: timm 1.0.31's own ViT, ``Attention`` and ``Mlp``
(imported in the rank from ``.venv/timm``, tests/_real_timm.py) under tensor parallel
``world_size``, against the dense model and torch's ``parallelize_module``."""

from __future__ import annotations

import copy
from typing import Any

import torch
from _workers_hf import B, _compare, _diff, _ours, _pieces_match, _run, _shard_names
from torch import nn

from _real_timm import import_timm
from paratrain.comm.context import WorkerContext
from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.tensor_parallel import parallelize

DIM = 192  # vit_tiny's width


def vit(num_heads: int = 4, seed: int = 0, **kw: Any) -> Any:  # timm.models.VisionTransformer
    """timm's ``vit_tiny_patch16_224`` made small: 32-pixel images in 8-pixel patches (16
    tokens and the class token), 2 blocks, 10 classes."""
    timm = import_timm()
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_heads=num_heads, img_size=32,
                             patch_size=8, depth=2, num_classes=10, **kw).eval()


def _conf(tp: int) -> TensorParallelismConfig:
    return TensorParallelismConfig.model_validate({"tensor_parallel_size": tp, "memory_optimization": "None"})


def _after_step(dense: nn.Module, tpm: Any) -> dict[str, float]:
    """One SGD step on the dense model and on the parallel one (each holding the gradients
    of ``_run``): the largest difference of the dense state and of the next outputs. SGD, not
    Adam: Adam's first step is ``lr * sign(grad)``, so a gradient that is zero in one model and
    1e-12 in the other (summation order) moves a weight by ``lr`` in one only."""
    for m in (dense, tpm):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    state, want = tpm.dense_state_dict(), dense.state_dict()
    x = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = dense(x)
        # relative to the outputs' scale: after a step at lr 0.5 the logits reach ~10, and a
        # CPU with other SIMD widths sums in another order (1.1e-5 absolute seen on AVX-512)
        return {"state": max(_diff(state[k], want[k]) for k in want),
                "out": _diff(tpm(x), out) / max(1.0, float(out.abs().max())),
                "moved": max(_diff(want[k], v) for k, v in vit().state_dict().items())}


def vit_suite(ctx: WorkerContext) -> dict[str, Any]:
    """The ViT (4 heads, and with per-head ``qk_norm``) dense vs ours: outputs, gathered
    gradients, one SGD step; the layout notes, the packed qkv's dense names and pieces,
    and ours with a plan (block 0's attention kept whole, its Mlp's Linears and the head by
    plan styles) beside the rules for the rest."""
    tp = ctx.world_size
    dense = vit()
    ref_model = copy.deepcopy(dense)
    ref = _run(ref_model, "timm")
    ours, tpm = _ours(dense, "timm", tp, memory_optimization="None")
    names, shards = _shard_names(tpm)
    res: dict[str, Any] = {"auto": _compare(ref, ours), "sharding": tpm.sharding, "names": names,
                           "shards": shards, "pieces": _pieces_match(tpm, names, shards, dense.state_dict()),
                           "types": [type(m).__module__ + "." + type(m).__name__
                                     for m in (dense.blocks[0], dense.blocks[0].attn, dense.blocks[0].mlp)]}
    res["step"] = _after_step(ref_model, tpm)
    qk = vit(qk_norm=True)  # LayerNorm over head_dim on q and k: replicated, gradients summed
    res["qk_norm"] = _compare(_run(copy.deepcopy(qk), "timm"), _ours(qk, "timm", tp, memory_optimization="None")[0])
    plan = {"blocks.0.attn": "replicate", "blocks.0.mlp.fc1": "colwise_gather_output",
            "blocks.0.mlp.fc2": {"style": "rowwise", "input": "replicate"}, "head": "colwise_gather_output"}
    planned, ptpm = _ours(dense, "timm", tp, memory_optimization="None", plan=plan)
    res["plan"], res["plan_layout"] = _compare(ref, planned), ptpm.layout()
    return res


def block_call_suite(ctx: WorkerContext) -> dict[str, Any]:
    """timm's ``Block.forward`` on the parallel attention, called as timm calls it
    (``attn(x, attn_mask=..., is_causal=...)``: a mask per head or broadcast, boolean or
    float; ``is_causal``), fused and unfused attention, against the dense block."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(3)
    n = 17  # 16 patches and the class token
    x = torch.randn(B, n, DIM, generator=g)
    mask = torch.rand(B, 4, n, n, generator=g) > 0.3
    mask[..., 0] = True  # every query keeps one key
    calls: dict[str, dict[str, Any]] = {"plain": {}, "causal": {"is_causal": True}, "mask": {"attn_mask": mask},
             "float_mask": {"attn_mask": torch.randn(B, 1, n, n, generator=g)}}
    for fused in (True, False):
        dense = vit()
        dense.blocks[0].attn.fused_attn = fused
        tpm = parallelize(copy.deepcopy(dense), _conf(ctx.world_size))
        tpm.train(False)
        with torch.no_grad():
            for k, kw in calls.items():
                got = tpm.module.blocks[0](x, **kw)
                out[f"{k}_{'fused' if fused else 'unfused'}"] = _diff(got, dense.blocks[0](x, **kw))
    with torch.no_grad():  # non-vacuity: each call changes the dense block's output
        out["moves"] = min(_diff(dense.blocks[0](x, **kw), dense.blocks[0](x)) for kw in calls.values() if kw)
    return out


def mlp_vs_torch_suite(ctx: WorkerContext) -> dict[str, Any]:
    """timm's ``Mlp`` under ours and under torch's ``parallelize_module`` with the same plan
    (``fc1`` ColwiseParallel, ``fc2`` RowwiseParallel) on ``DeviceMesh("cpu", ranks)``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    timm = import_timm()
    torch.manual_seed(0)
    mlp = timm.layers.Mlp(DIM, 4 * DIM)
    ref = _run(copy.deepcopy(mlp), "tokens")
    ours, tpm = _ours(mlp, "tokens", ctx.world_size, memory_optimization="None")
    theirs = copy.deepcopy(mlp)
    parallelize_module(theirs, DeviceMesh("cpu", list(range(ctx.world_size))),
                       {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    out, grads = _run(theirs, "tokens")
    torch_ref = (out, {k: g.full_tensor() if isinstance(g, DTensor) else g for k, g in grads.items()})
    return {"type": type(mlp).__module__, "ours": _compare(ref, ours), "torch": _compare(ref, torch_ref),
            "ours_vs_torch": _compare(torch_ref, ours), "sharding": tpm.sharding}


def refusals_suite(ctx: WorkerContext) -> dict[str, str]:
    """The ConfigError (or ValueError) of what cannot be sharded with the same function: 3
    heads on 2 ranks; a whole-width ``norm`` (timm's ``scale_norm``); the gated attention."""
    timm = import_timm()
    make = {"heads": lambda: vit(num_heads=3),
            "scale_norm": lambda: timm.layers.Attention(DIM, 4, scale_norm=True, norm_layer=nn.LayerNorm),
            "gated": lambda: timm.layers.Attention(DIM, 4, gated=True)}
    out = {}
    for k, f in make.items():
        try:
            parallelize(f(), _conf(ctx.world_size))
            out[k] = ""
        except (ConfigError, ValueError) as e:
            out[k] = f"{type(e).__name__}: {e}"
    return out
