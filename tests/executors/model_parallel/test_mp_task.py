"""ModelParallel trains any Task through the one loop (PipelineEngine).

- Parity: on 2 gloo ranks, one ``forward_backward`` of the pipeline (GPipe and 1F1B with
  uneven micro-batches, and the unpipelined Direct protocol) gives Local's loss and every parameter gradient on the same batch
  (rtol 1e-5, fp32) for regression (diabetes, MSE), a tiny GPT (language model) and a
  user's Task; the all-reduced ``grad_sq_norm`` (what clipping reads) is Local's whole-model
  norm. Non-vacuity: a wrong loss reduction (sum instead of mean; summed micro-batch means)
  fails the same comparison.
- The tied GPT head split from its embedding is a ConfigError naming model.tie_weights.
- Resume: a Pipeline run with a cosine schedule, warm-up, clipping, grad_accumulation = 2
  and bf16, SIGKILLed at a step and restarted by the elastic agent, ends with the
  uninterrupted run's parameters_sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from paratrain.comm.context import WorkerContext, default_workers
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig
from paratrain.training import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RTOL, ATOL = 1e-5, 1e-7


class SeqUserTask:
    """A user's task (public protocol only): a small Sequential regressor, L1 loss."""

    name = "user_l1"
    fitness_metric = "mae"
    fitness_mode = "min"

    def datasets(self, seed: int) -> tuple[TensorDataset, TensorDataset]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(96, 5, generator=g)
        y = x @ torch.linspace(-1, 1, 5).reshape(5, 1)
        return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])

    def build_model(self, model_spec: Any, train: Any) -> nn.Module:
        return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 1))

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.l1_loss(output, batch[1])

    def eval_batch(self, output: torch.Tensor, batch: Any) -> dict[str, float]:
        return {"ae": float((output - batch[1]).abs().sum()), "count": len(batch[1])}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        mae = sums.get("ae", 0.0) / max(sums.get("count", 0.0), 1.0)
        return {"loss": mae, "mae": mae}


def make_seq_user_task() -> SeqUserTask:
    return SeqUserTask()


def _pipe(mbs: int | None, sched: str | None, split: list[str]) -> dict[str, Any]:
    """A 2-stage Pipeline (``sched`` None: the unpipelined Direct protocol)."""
    comm = ({"protocol": "Direct"} if sched is None else
            {"protocol": "Pipeline", "micro_batch_size": mbs, "schedule": sched})
    return {"type": "ModelParallel", "communication": comm,
            "partitions": [{"node_ids": split, "target": {"WorkerId": "worker-1"}}]}


REG = {"task": {"name": "regression"}, "data": {"name": "diabetes"},
       "model": {"name": "mlp", "hidden": [16, 8]}}
GPT = {"task": {"name": "language_model", "block_size": 16}, "data": {"name": "shakespeare"},
       "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "tie_weights": False}}
USER = {"task": {"factory": "test_mp_task:make_seq_user_task"}}
REG_SPLIT, GPT_SPLIT, USER_SPLIT = ["fc1", "act1", "head"], ["block1", "ln_f", "head"], ["2", "3", "4"]

# (name, job sections, stage-1 nodes, rows, micro_batch_size, schedule, weight)
CASES = [
    ("reg-1f1b", REG, REG_SPLIT, 20, 6, "1F1B", 1.0),     # micro-batches 6,6,6,2
    ("reg-gpipe", REG, REG_SPLIT, 20, 6, "GPipe", 1.0),
    ("gpt-1f1b", GPT, GPT_SPLIT, 10, 4, "1F1B", 1.0),     # 4,4,2
    ("gpt-gpipe", GPT, GPT_SPLIT, 10, 4, "GPipe", 1.0),
    ("user-1f1b", USER, USER_SPLIT, 13, 5, "1F1B", 0.25),  # an accumulation weight
    ("gpt-direct", GPT, GPT_SPLIT, 6, None, None, 0.5),   # not pipelined: the batch whole
]


def _job(doc: dict[str, Any], strategy: dict[str, Any], **train: Any) -> JobConfig:
    return JobConfig.model_validate({**doc, "run": {"name": "p", "seed": 4},
                                     "train": {"batch_size": 8, **train}, "strategy": strategy})


def _grads(named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    out = {}
    for name, p in named:
        assert p.grad is not None, f"{name} has no gradient"
        out[name] = p.grad.detach().numpy().copy()
    return out


def pipeline_worker(ctx: WorkerContext) -> list[dict[str, Any]]:
    """One forward_backward per case on this rank (the engine the runner uses)."""
    from paratrain.comm.p2p import P2PTransport
    from paratrain.executors.model_parallel.engine import PipelineEngine, StageModel
    from paratrain.executors.model_parallel.runtime import StageRuntime, held_attrs, segment_modules
    from paratrain.executors.model_parallel.validation import plan_for, task_model
    from paratrain.task import fetch_batch

    out = []
    for _, doc, split, rows, mbs, sched, weight in CASES:
        transport = P2PTransport(ctx.group)  # its shape cache is per model
        job = _job(doc, _pipe(mbs, sched, split))
        task, train, test, model = task_model(job)
        plan = plan_for(job, model, ctx.workers)
        modules = segment_modules(model, plan, ctx.rank)
        attrs = held_attrs(model, plan, ctx.rank)
        stage = StageModel(modules, attrs)
        rt = StageRuntime(plan, ctx.rank, modules, transport, attrs=attrs)
        engine = PipelineEngine(ctx, rt, stage, task, test, precision="fp32",
                                micro_batch_size=mbs, schedule_name=sched)
        batch = fetch_batch(train, torch.arange(rows))
        loss = engine.forward_backward(batch, weight=weight, last=True)
        names = {id(p): k for k, p in model.named_parameters()}
        named = [(names[id(p)], p) for p in stage.parameters()]
        out.append({"loss": loss, "grads": _grads(named), "sq": engine.grad_sq_norm(),
                    "last": ctx.rank == plan.last_rank,
                    "order": [f"{k}{i}" for k, i, _ in rt.stats.order]})
        transport.close()
    return out


@pytest.fixture(scope="module")
def pipelined() -> list[list[dict[str, Any]]]:
    return run_distributed(pipeline_worker, 2, timeout_s=200)


def _local(doc: dict[str, Any], split: list[str], rows: int, weight: float, *,
           loss: Any = None) -> tuple[float, dict[str, Any]]:
    """Local's loss and gradients on the batch (LocalEngine: the one loop's reference)."""
    from paratrain.executors.model_parallel.validation import task_model
    from paratrain.task import fetch_batch
    from paratrain.training.loop import LocalEngine

    task, train, test, model = task_model(_job(doc, _pipe(4, "1F1B", split)))
    if loss is not None:
        task.loss = loss
    engine = LocalEngine(model, task, test, device=torch.device("cpu"))
    value = engine.forward_backward(fetch_batch(train, torch.arange(rows)), weight=weight, last=True)
    return value, _grads(list(model.named_parameters()))


def _merged(per_rank: list[dict[str, Any]]) -> tuple[float, dict[str, torch.Tensor]]:
    losses = [r["loss"] for r in per_rank if r["last"]]
    assert len(losses) == 1 and all(r["loss"] == 0.0 for r in per_rank if not r["last"])
    grads: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for k, g in r["grads"].items():
            assert k not in grads, f"{k} on two ranks"
            grads[k] = torch.from_numpy(g)
    return losses[0], grads


def _close(loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict[str, Any]) -> bool:
    if set(grads) != set(ref) or loss != pytest.approx(ref_loss, rel=RTOL):
        return False
    return all(torch.allclose(grads[k], torch.from_numpy(g), rtol=RTOL, atol=ATOL) for k, g in ref.items())


@pytest.mark.parametrize("i", range(len(CASES)))
def test_pipeline_gradients_equal_local(pipelined: list[list[dict[str, Any]]], i: int) -> None:
    name, doc, split, rows, mbs, sched, weight = CASES[i]
    per_rank = [pipelined[r][i] for r in range(2)]
    loss, grads = _merged(per_rank)
    ref_loss, ref = _local(doc, split, rows, weight)
    assert loss == pytest.approx(ref_loss, rel=RTOL), name
    assert set(grads) == set(ref)
    on_stage1 = {k.rsplit(".", 1)[0] for k in per_rank[1]["grads"]}
    # really split: stage 1 holds its own nodes (and modules under them) only
    assert on_stage1 and all(any(m == s or m.startswith(s + ".") for s in split) for m in on_stage1)
    assert not {k.split("/")[0] for k in per_rank[0]["grads"]} & set(split)
    for k, g in ref.items():
        torch.testing.assert_close(grads[k], torch.from_numpy(g), rtol=RTOL, atol=ATOL, msg=f"{name}: {k}")
    assert _close(loss, grads, ref_loss, ref)
    # clipping reads the whole model's norm: both ranks hold the all-reduced sum of squares
    whole = sum(float(torch.from_numpy(g).double().pow(2).sum()) for g in ref.values())
    assert per_rank[0]["sq"] == per_rank[1]["sq"] == pytest.approx(whole, rel=1e-6)
    m = 1 if mbs is None else -(-rows // mbs)
    assert len(per_rank[0]["order"]) == 2 * m
    if sched is None:
        assert per_rank[0]["order"] == ["F0", "B0"]
    elif sched == "GPipe":
        assert per_rank[0]["order"] == [f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)]
    else:  # stage 0 of 2: one warm-up forward, then 1F1B
        assert per_rank[0]["order"][:3] == ["F0", "F1", "B0"]


@pytest.mark.parametrize("i", [0, 2])
def test_non_vacuity_wrong_loss_reduction_fails(pipelined: list[list[dict[str, Any]]], i: int) -> None:
    """The same comparison rejects a sum-instead-of-mean loss and the classic pipeline bug
    of summing micro-batch means (no n_i / B weight)."""
    _, doc, split, rows, mbs, _, weight = CASES[i]
    loss, grads = _merged([pipelined[r][i] for r in range(2)])
    ref_loss, ref = _local(doc, split, rows, weight)
    assert _close(loss, grads, ref_loss, ref)
    reduce_sum = {"reg": lambda out, b: nn.functional.mse_loss(out.reshape(b[1].shape), b[1], reduction="sum"),
                  "gpt": lambda out, b: nn.functional.cross_entropy(
                      out.reshape(-1, out.shape[-1]), b[1].reshape(-1), reduction="sum")}
    kind = CASES[i][0].split("-")[0]
    wrong_loss, wrong = _local(doc, split, rows, weight, loss=reduce_sum[kind])
    assert not _close(loss, grads, wrong_loss, wrong)
    # summed micro-batch means = the mean loss with every micro-batch weighted 1, not n_i/B
    from paratrain.executors.model_parallel.validation import task_model
    from paratrain.task import fetch_batch

    task, train, _, model = task_model(_job(doc, _pipe(mbs, "1F1B", split)))
    batch = fetch_batch(train, torch.arange(rows))
    total = 0.0
    for a in range(0, rows, mbs):
        part = tuple(t[a:a + mbs] for t in batch)
        piece = task.loss(model(part[0]), part)
        (piece * weight).backward()
        total += float(piece.detach())
    summed = _grads(list(model.named_parameters()))
    assert not _close(loss, grads, total, summed)


def test_tied_gpt_head_split_across_stages_keeps_one_tensor() -> None:
    """The head reads the token embedding's weight: split across stages, the weight stays
    on the embedding's rank and is sent to the head's (its gradient comes back)."""
    from paratrain.executors.model_parallel.validation import plan_for, task_model

    tied = {**GPT, "model": {**GPT["model"], "tie_weights": True}}
    job = _job(tied, _pipe(4, "1F1B", GPT_SPLIT))
    *_, model = task_model(job)
    plan = plan_for(job, model, default_workers(2))
    (attr,) = plan.cut.attrs
    assert attr.target == "embed.tok.weight" and attr.rank == 0
    assert [(t.src, t.dst) for t in plan.cut.transfers if t.value == attr.name] == [(0, 1)]
    # embed and head on rank 0 around the blocks on rank 1: a cycle, fine for Direct only
    together = _job(tied, _pipe(4, "1F1B", ["block0", "block1", "ln_f"]))
    with pytest.raises(ConfigError, match="one contiguous run"):
        plan_for(together, model, default_workers(2))
    direct = _job(tied, {**_pipe(4, "1F1B", ["block0", "block1", "ln_f"]),
                         "communication": {"protocol": "Direct"}})
    plan_for(direct, model, default_workers(2))


def _resume_job(tmp: Path, name: str, restarts: int = 0) -> JobConfig:
    doc = {**REG, "run": {"name": name, "seed": 2, "output_dir": str(tmp), "checkpoint_every": 2,
                          "max_restarts": restarts},
           "train": {"epochs": 1, "batch_size": 16, "max_steps": 6, "eval_every": 3,
                     "grad_accumulation": 2, "lr_schedule": "cosine", "warmup_steps": 2,
                     "grad_clip_norm": 0.5, "precision": "bf16",
                     "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.01}},
           "strategy": _pipe(6, "1F1B", REG_SPLIT)}
    return JobConfig.model_validate(doc)


def test_kill_and_elastic_restart_is_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cosine + warm-up + clip + accumulation 2 + bf16: rank 1 SIGKILLs itself after step
    3; the restart resumes from the step-2 checkpoints (optimizer, scheduler, RNG,
    position) and ends with the uninterrupted run's parameters."""
    from paratrain.dispatch import execute
    from paratrain.training.faults import FAULT_ENV

    whole = execute(_resume_job(tmp_path, "whole"))
    assert whole["steps"] == 6 and whole["task"] == "regression"
    assert {"test_loss", "test_mse", "test_r2", "best_test_mse"} <= set(whole)
    monkeypatch.setenv(FAULT_ENV, "1:3")
    killed = execute(_resume_job(tmp_path, "killed", restarts=1))
    assert killed["restart_count"] == 1 and killed["resumed_from_step"] == 2 and killed["steps"] == 6
    assert killed["parameters_sha256"] == whole["parameters_sha256"]
    assert killed["test_loss"] == whole["test_loss"]
    # the restarted run replayed the same evaluations (the last stage's losses, rank 0's log)
    def records(s: dict[str, Any]) -> list[tuple[int, float, float]]:
        return [(r["step"], r["train_loss"], r["test_mse"]) for r in read_metrics(s["run_dir"])]
    assert [r[0] for r in records(whole)] == [3, 6]
    assert records(killed) == records(whole)
    assert all(r[1] > 0 for r in records(whole)), "rank 0 logs the last stage's training loss"
