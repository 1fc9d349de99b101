"""Rank function for the recomputation-traffic tests: one training step of a tiny zoo GPT or
HF Llama under every ``memory_optimization`` level, and under the policy before the
collective tape (``recompute_collectives = True``: a recomputed segment runs its forward
collectives again), with what each step cost: collectives by kind, collectives read back
from the tape, the peak of the activation bytes saved for backward (``measure_activations``,
a ``saved_tensors_hooks`` meter), and the gradient shards, compared with ``None``'s.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from paratrain.comm.context import WorkerContext
from paratrain.config import TensorParallelismConfig
from paratrain.tensor_parallel import parallelize

LEVELS = ["None", "Low", "Medium", "High", "Extreme"]
B, T, VOCAB = 2, 16, 50


def _dense(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from paratrain.models.gpt import gpt

        return gpt((T,), VOCAB, n_layer=4, n_head=4, n_embd=32)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _loss(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids) if kind == "gpt" else model(input_ids=ids).logits
    return F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def suite(ctx: WorkerContext, cases: list[tuple[str, str, list[str]]]) -> dict[str, Any]:
    """:func:`step_costs` for each ``(model kind, communication pattern, levels)``, in one
    process pair."""
    torch.set_num_threads(1)
    return {f"{kind}/{pattern}": step_costs(ctx, kind, pattern, levels) for kind, pattern, levels in cases}


def step_costs(ctx: WorkerContext, kind: str, pattern: str = "AllReduce",
               levels: list[str] | None = None) -> dict[str, Any]:
    """Per level (and ``"Medium-rerun"``, the old policy): the step's collectives, replays,
    peak saved-activation bytes, loss, and the largest gradient difference from ``None``
    relative to ``None``'s largest gradient (this rank's shards)."""
    dense = _dense(kind).train()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    res: dict[str, Any] = {}
    ref: dict[str, torch.Tensor] = {}
    for name in [*(levels or LEVELS), "Medium-rerun"]:
        level = name.split("-")[0]
        tpm = parallelize(copy.deepcopy(dense), TensorParallelismConfig(
            tensor_parallel_size=ctx.world_size, memory_optimization=level,
            communication_pattern=pattern))
        if name.endswith("rerun"):
            tpm.recompute_collectives = True
        tpm.train()
        tpm.stats.reset()
        with tpm.measure_activations() as meter:
            loss = _loss(tpm, kind, ids)
            loss.backward()
        st = tpm.statistics()
        grads = {n: p.grad.detach().clone() for n, p in tpm.named_parameters() if p.grad is not None}
        if name == "None":
            ref = grads
        scale = max(float(g.abs().max()) for g in ref.values())
        res[name] = {
            "collectives": st["collectives"], "total": st["total_collectives"],
            "replayed": st["replayed_collectives"], "bytes": st["bytes_sent_modelled"],
            "peak": meter.peak, "loss": float(loss.detach()),
            "grad_rel_diff": max(float((grads[n] - g).abs().max()) for n, g in ref.items()) / scale,
            "same_grads": sorted(grads) == sorted(ref),
        }
        tpm.comm.close()
    return res
