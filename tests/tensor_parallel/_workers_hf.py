"""Rank functions for the tests of tensor parallelism on modules paratrain did not write:
tiny HF Llama / GPT-2 built from config (timm's own ViT: _workers_timm.py, which uses the
forward/backward and comparison helpers here).

Each check compares, on every rank, the logits and the (gathered) parameter gradients of
the parallel model with the dense one's, and with torch's ``parallelize_module`` given the
same plan. Results are maximum absolute differences (and the dense scale), asserted by the
test modules.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.tensor_parallel import parallelize

B, S, VOCAB = 2, 8, 65

# HF's LlamaConfig.base_model_tp_plan (transformers 5.24), under LlamaForCausalLM's "model."
LLAMA_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def llama(heads: int = 4, kv_heads: int = 2, hidden: int = 32, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def mistral(seed: int = 0) -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        sliding_window=4, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return MistralForCausalLM(cfg).eval()


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


# -- forward / backward on a model, dense or parallel -------------------------------------
def _inputs(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "tokens":  # timm's Mlp on vit_tiny's width
        return torch.randn(B, S, 192, generator=g)
    if kind == "timm":
        return torch.randn(B, 3, 32, 32, generator=g)
    return torch.randint(0, VOCAB, (B, S), generator=g)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _run(model: nn.Module, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and parameter gradients of a fixed random weighting of the logits."""
    out = _logits(model(_inputs(kind)))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _dense(kind: str, **kw: Any) -> nn.Module:
    return {"llama": llama, "mistral": mistral, "gpt2": gpt2}[kind](**kw)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _compare(ref: tuple[torch.Tensor, dict[str, torch.Tensor]],
             got: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> dict[str, Any]:
    r_out, r_grads = ref
    g_out, g_grads = got
    missing = sorted(set(r_grads) ^ set(g_grads))
    gd = max((_diff(r_grads[n], g_grads[n]) / max(1.0, float(r_grads[n].abs().max()))
              for n in r_grads if n in g_grads), default=float("inf"))
    return {"out": _diff(r_out, g_out) / max(1.0, float(r_out.abs().max())), "grads": gd,
            "missing": missing}


def _ours(dense: nn.Module, kind: str, tp: int, **cfg: Any) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], Any]:
    conf = TensorParallelismConfig.model_validate({"tensor_parallel_size": tp, **cfg})
    tpm = parallelize(copy.deepcopy(dense), conf)
    tpm.train(False)
    out, local = _run(tpm, kind)
    full = tpm.gather_full({n.removeprefix("module."): g for n, g in local.items()})
    return (out, full), tpm


def _torch_reference(dense: nn.Module, kind: str, tp: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """torch.distributed.tensor.parallel.parallelize_module with the same plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    ref = copy.deepcopy(dense)
    if kind == "llama":
        parallelize_module(ref, mesh, {k: style[v]() for k, v in LLAMA_PLAN.items()})
        out, grads = _run(ref, kind)
        return out, {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    # GPT-2: torch's styles take nn.Linear only, so each Conv1D becomes the Linear it is
    # (weight transposed); c_attn's rows are ordered [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] so
    # that ColwiseParallel's contiguous chunk r is rank r's packed heads; split_size is set
    # to the local width by hand (as torchtitan sets local head counts).
    e = ref.config.n_embd
    w = e // tp
    perm = torch.cat([torch.arange(c * e + r * w, c * e + (r + 1) * w) for r in range(tp) for c in range(3)])
    plan: dict[str, Any] = {}
    for i, block in enumerate(ref.transformer.h):
        for mod, name, st, p in ((block.attn, "c_attn", "colwise", perm), (block.attn, "c_proj", "rowwise", None),
                                 (block.mlp, "c_fc", "colwise", None), (block.mlp, "c_proj", "rowwise", None)):
            conv = getattr(mod, name)
            lin = nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
            with torch.no_grad():
                wt, bt = conv.weight.t(), conv.bias
                lin.weight.copy_(wt[p] if p is not None else wt)
                lin.bias.copy_(bt[p] if p is not None else bt)
            setattr(mod, name, lin)
            where = "attn" if mod is block.attn else "mlp"
            plan[f"transformer.h.{i}.{where}.{name}"] = style[st]()
        block.attn.split_size = w
    parallelize_module(ref, mesh, plan)
    out, grads = _run(ref, kind)
    full = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    inv = torch.argsort(perm)
    for n in list(full):
        if ".c_attn." in n or ".c_fc." in n or ".c_proj." in n:
            g = full[n]
            if ".c_attn." in n:
                g = g[inv]
            full[n] = g.t().contiguous() if n.endswith("weight") else g
    return out, full


# -- rank entries --------------------------------------------------------------------------
def hf_suite(ctx: WorkerContext, kind: str, model_kw: dict[str, Any], full: bool = True) -> dict[str, Any]:
    """Dense vs ours (no plan, Memory None and the default Medium checkpointing), ours with
    HF's plan (Llama), torch's parallelize_module, the dense state of the shards, and a
    wrong shard (``full``: also the checkpointed run and the wrong shard)."""
    tp = ctx.world_size
    dense = _dense(kind, **model_kw)
    ref = _run(copy.deepcopy(dense), kind)
    res: dict[str, Any] = {}
    ours, tpm = _ours(dense, kind, tp, memory_optimization="None")
    res["auto"] = _compare(ref, ours)
    res["sharding"] = tpm.sharding
    res["local_params"] = sum(p.numel() for p in tpm.parameters())
    res["dense_params"] = sum(p.numel() for p in dense.parameters())
    state, want = tpm.dense_state_dict(), dense.state_dict()
    res["state"] = {"keys": sorted(set(state) ^ set(want)),
                    "diff": max(_diff(state[k], want[k]) for k in want if k in state)}
    names, shards = _shard_names(tpm)
    res["shard_names"] = sorted(set(names.values()) - set(want))
    res["shards"] = shards
    res["pieces"] = _pieces_match(tpm, names, shards, want)
    if full:
        res["auto_checkpointed"] = _compare(ref, _ours(dense, kind, tp)[0])
    torch_ref = _torch_reference(dense, kind, tp)
    res["torch_vs_dense"] = _compare(ref, torch_ref)
    res["torch_vs_ours"] = _compare(torch_ref, ours)
    if kind == "llama":
        planned, _ = _ours(dense, kind, tp, memory_optimization="None", plan=LLAMA_PLAN)
        res["plan"] = _compare(ref, planned)
        res["plan_vs_torch"] = _compare(torch_ref, planned)
        if not full:
            return res
        # Mistral: Llama's attention with a sliding window (4 of 8 positions), an odd-width MLP
        m = mistral()
        res["mistral"] = _compare(_run(copy.deepcopy(m), "mistral"),
                                  _ours(m, "mistral", tp, memory_optimization="None")[0])
        # wrong: the kv heads left whole (replicated) while the query heads are split
        wrong = {k: v for k, v in LLAMA_PLAN.items() if "k_proj" not in k and "v_proj" not in k}
        try:
            bad, _ = _ours(dense, kind, tp, memory_optimization="None", plan=wrong)
            res["wrong"] = _compare(ref, bad)["out"]
        except (RuntimeError, ValueError) as e:  # a shape error is as good a detection
            res["wrong"] = f"raised {type(e).__name__}"
    elif full:
        # wrong: c_attn cut into contiguous chunks (rank 0: all of q and half of k)
        plan = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}
        model = copy.deepcopy(dense)
        for block in model.transformer.h:
            block.attn.split_size = block.attn.split_size // tp
        bad, _ = _ours(model, kind, tp, memory_optimization="None", plan=plan)
        res["wrong"] = _compare(ref, bad)["out"]
    return res


def _pieces_match(tpm: Any, names: dict[str, str], shards: dict[str, Any],
                  want: dict[str, torch.Tensor]) -> float:
    """Max difference between each sharded tensor this rank holds and the piece of the dense
    tensor its spec names (``reshard.take``: what a resume on another size cuts out)."""
    from paratrain.training.reshard import take

    local = tpm.state_dict()
    return max(_diff(local[k], take(want[names[k]], spec)) for k, spec in shards.items())


def _shard_names(tpm: Any) -> tuple[dict[str, str], dict[str, Any]]:
    from paratrain.tensor_parallel.shards import dense_names_and_shards

    return dense_names_and_shards(tpm, rank=tpm.comm.rank)


def errors(kind: str, tp: int, **cfg: Any) -> str:
    """The ConfigError of sharding ``kind`` on rank 0 of ``tp`` (no processes: the dry run's
    construction)."""
    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import TPGroups
    from paratrain.tensor_parallel import TensorParallelModule

    conf = TensorParallelismConfig.model_validate({"tensor_parallel_size": tp, **cfg})
    comm = TPComm(None, list(range(tp)), rank=0, pattern="AllReduce")
    try:
        TensorParallelModule(_dense(kind), conf, TPGroups(comm, None, tp, 1, 0))
    except ConfigError as e:
        return str(e)
    return ""

