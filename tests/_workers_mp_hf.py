"""Tiny Hugging Face models (built from a config, no download) under ModelParallel: each
rank captures the model (torch.fx cannot trace it: torch.export, non-strict), keeps its
parts, and trains two SGD steps under each protocol of the case; the unpartitioned
reference runs the same two steps.

A case: ``model`` (``llama``: ``LlamaForCausalLM`` with its head tied to the token
embedding, grouped-query attention; ``gpt2``: ``GPT2LMHeadModel``, tied), ``feed``
(``first``: ``model(batch[0])`` with the logits' cross-entropy as the loss; ``dict``:
``model(**{"input_ids", "labels"})`` and the model's own ``.loss``), ``partitions`` and
``protocols`` (name, micro-batch size, schedule; ``None`` schedule = Direct).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.comm.context import WorkerContext
from paratrain.config.strategy import load_strategy
from paratrain.executors.model_parallel.engine import StageModel
from paratrain.executors.model_parallel.plan import build_plan
from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules
from paratrain.task.builtin import logits_of
from paratrain.task.steps import model_args

__all__ = ["build", "batch", "feed", "loss_fn", "reference", "run_cases", "VOCAB", "LR"]

VOCAB, T, LR = 24, 8, 0.5


def build(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(case.get("seed", 0))
    if case["model"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))


def batch(case: dict[str, Any], rows: int, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, VOCAB, (rows, T + 1), generator=g)
    if case["feed"] == "dict":
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, :-1].contiguous()}
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class _DictTask:
    """What a task whose batches are dicts says: ``model(**batch)`` (task.steps.model_args)."""


def feed(case: dict[str, Any]) -> Any:
    task = _DictTask() if case["feed"] == "dict" else None
    return lambda b: model_args(task, b)


def loss_fn(out: Any, b: Any) -> torch.Tensor:
    if isinstance(b, dict):
        return out.loss  # type: ignore[no-any-return]
    logits = logits_of(out)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))


def _call(model: nn.Module, case: dict[str, Any], b: Any) -> Any:
    args, kwargs = feed(case)(b)
    return model(*args, **kwargs)


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """Two full-batch SGD steps of the unpartitioned model: losses, first-step gradients,
    final parameters (by ``named_parameters()`` name: a tie under its first name)."""
    model = build(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for k in range(2):
        opt.zero_grad(set_to_none=True)
        b = batch(case, case["rows"], seed=k)
        loss = loss_fn(_call(model, case, b), b)
        loss.backward()
        losses.append(float(loss.detach()))
        if k == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def run_cases(ctx: WorkerContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from paratrain.comm.p2p import P2PTransport

    out = []
    for case in cases:
        model = build(case)
        names = {id(p): n for n, p in model.named_parameters()}
        start = {k: v.clone() for k, v in model.state_dict().items()}
        strategy = load_strategy({"type": "ModelParallel", "partitions": case["partitions"],
                                  "communication": {"protocol": "Direct"}})
        plan = build_plan(model, strategy.partitions, ctx.workers, contiguous=True,
                          example=feed(case)(batch(case, 2, seed=99)))
        modules = segment_modules(model, plan, ctx.rank)
        attrs = held_attrs(model, plan, ctx.rank)
        stage = StageModel(modules, attrs, plan.segments_of(ctx.rank))
        runs: dict[str, Any] = {}
        for label, micro, schedule in case["protocols"]:
            model.load_state_dict(start)  # the same start for every protocol
            opt = torch.optim.SGD(stage.parameters(), lr=LR)
            rt = StageRuntime(plan, ctx.rank, modules, P2PTransport(ctx.group), attrs=attrs,
                              feed=feed(case))
            losses, grads = [], {}
            for k in range(2):
                opt.zero_grad(set_to_none=True)
                loss = rt.run_batch(batch(case, case["rows"], seed=k), step=k,
                                    micro_batch_size=micro, schedule_name=schedule, loss_fn=loss_fn)
                losses.append(loss)
                if k == 0:
                    grads = {names[id(p)]: p.grad.detach().clone() for p in stage.parameters()
                             if p.grad is not None}
                opt.step()
            runs[label] = {"losses": losses, "grads": grads,
                           "params": {names[id(p)]: p.detach().clone() for p in stage.parameters()}}
        out.append({"runs": runs, "parts": [list(p.nodes) for p in plan.segments_of(ctx.rank)],
                    "capture": plan.cut.capture,
                    "crossing": [t.value for t in plan.cut.transfers]})
    return out
