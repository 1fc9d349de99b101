"""DataParallel with a Local subgraph (``[subgraphs.head] type = "Local"``, issue 15 part 3).

On 2 gloo ranks: the head is not synchronised (each replica keeps its own copy, so the copies
differ after training) while every other parameter is bitwise equal across ranks, under
AllReduce (bucketed), compressed AllReduce (TopK) and ParameterServer; AllReduce and
ParameterServer equal an independent single-process reference (per-replica gradients, the
shared ones averaged by hand, the head's left alone) and differ from the same reference with
the head averaged too (the test can fail). A run stopped at a checkpoint and resumed in fresh
processes ends bit-identical on every rank (each rank reloads its own head).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from paratrain.comm.dcp import read_metadata
from paratrain.comm.testing import run_distributed
from paratrain.files import step_folders
from paratrain.training.stores import read_rank_state

pytestmark = pytest.mark.timeout(300)

SEED = 5
BATCH = 8
STEPS = 6
SGD = {"name": "sgd", "lr": 0.2, "momentum": 0.9}
AR = {"method": "AllReduce"}
PS = {"method": "ParameterServer"}
TOPK = {"method": "TopK", "k": 30}
# name -> (aggregation, compression, train.grad_clip_norm)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any] | None, float | None]] = {
    "allreduce": (AR, None, None), "allreduce_topk": (AR, TOPK, None), "ps": (PS, None, None),
    # the clip coefficient must be the same on every rank (the local norms differ)
    "allreduce_clip": (AR, None, 0.05),
}
LOCAL = ("head.weight", "head.bias")


def _job(tmp: str, name: str, aggregation: dict[str, Any], compression: dict[str, Any] | None,
         steps: int, clip: float | None = None) -> Any:
    from paratrain.config import load_job

    doc: dict[str, Any] = {
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": 3},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": BATCH, "max_steps": steps, "optimizer": SGD,
                  "grad_clip_norm": clip},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": aggregation},
        "subgraphs": {"head": {"type": "Local"}},
    }
    if compression is not None:
        doc["compression"] = compression
    return load_job(doc)


def _params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def phase(ctx: Any, tmp: str, which: str) -> dict[str, Any]:
    """``first``: every variant for STEPS steps, and the resume case stopped after 3 (its
    checkpoint); ``second`` (fresh processes): the resume case continued to STEPS."""
    from paratrain.executors.data_parallel.runner import train_replica

    out: dict[str, Any] = {}
    if which == "first":
        for name, (agg, comp, clip) in VARIANTS.items():
            model, summary = train_replica(ctx, _job(tmp, name, agg, comp, STEPS, clip), False,
                                           plot=False)
            out[name] = _params(model)
            out[f"{name}_summary"] = summary
        train_replica(ctx, _job(tmp, "part", AR, None, 3), False, plot=False)
    else:
        model, summary = train_replica(ctx, _job(tmp, "part", AR, None, STEPS), True, plot=False)
        out["resumed"] = _params(model)
        out["resumed_summary"] = summary
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dp_local")
    first = run_distributed(phase, 2, str(tmp), "first", timeout_s=240)
    ckpt = step_folders(tmp / "part" / "checkpoints")
    heads = {r: read_rank_state(ckpt[-1], r) for r in range(2)}
    second = run_distributed(phase, 2, str(tmp), "second", timeout_s=240)
    return {"first": first, "second": second, "tmp": tmp, "ckpt": ckpt, "ckpt_state": heads}


def reference(aggregate_head: bool) -> list[dict[str, np.ndarray]]:
    """Two replicas in one process: the shards and init the runner uses, each replica's own
    gradients, ``g <- (g_0 + g_1) / 2`` for the shared parameters (and for the head too when
    ``aggregate_head``), one SGD step per replica."""
    from paratrain.executors.data_parallel.runner import shard_indices
    from paratrain.task import resolve_task
    from paratrain.training import build_optimizer, seed_everything

    job = _job("unused", "ref", AR, None, STEPS)
    seed_everything(SEED)
    task = resolve_task(job)
    train, _ = task.datasets(SEED)
    init = task.build_model(job.model, train)
    x, y = train.tensors
    models = [init, copy.deepcopy(init)]
    opts = [build_optimizer(m.parameters(), job.train.optimizer) for m in models]
    shards = [shard_indices(len(y), world=2, rank=r, seed=SEED, epoch=0) for r in range(2)]
    for b in range(STEPS):
        for r, m in enumerate(models):
            opts[r].zero_grad(set_to_none=True)
            sel = shards[r][b * BATCH : (b + 1) * BATCH]
            task.loss(m(x[sel]), (x[sel], y[sel])).backward()
        named = [dict(m.named_parameters()) for m in models]
        for n in named[0]:
            if n in LOCAL and not aggregate_head:
                continue
            mean = (named[0][n].grad + named[1][n].grad) / 2
            for r in range(2):
                named[r][n].grad = mean.clone()
        for o in opts:
            o.step()
    return [_params(m) for m in models]


def test_the_local_head_differs_and_every_other_parameter_is_bitwise_equal(runs: dict[str, Any]) -> None:
    r0, r1 = runs["first"]
    for name in VARIANTS:
        a, b = r0[name], r1[name]
        shared = [n for n in a if n not in LOCAL]
        assert shared and all(np.array_equal(a[n], b[n]) for n in shared), name
        assert all(not np.allclose(a[n], b[n]) for n in LOCAL), name
        s = r0[f"{name}_summary"]
        assert s["local_subgraphs"] == ["head"] and s["local_parameters"] == sorted(LOCAL)
        digests = s["parameters_sha256_by_rank"]
        assert digests == r1[f"{name}_summary"]["parameters_sha256_by_rank"]
        assert digests[0] == s["parameters_sha256"] and digests[0] != digests[1]


@pytest.mark.parametrize("name", ["allreduce", "ps"])
def test_equals_the_hand_averaged_reference(runs: dict[str, Any], name: str) -> None:
    ref = reference(aggregate_head=False)
    wrong = reference(aggregate_head=True)
    for rank in range(2):
        got = runs["first"][rank][name]
        for n, v in got.items():
            np.testing.assert_allclose(v, ref[rank][n], rtol=1e-5, atol=1e-6, err_msg=f"{name} {n}")
        # non-vacuity: averaging the head too gives another result
        assert any(not np.allclose(got[n], wrong[rank][n], rtol=1e-5, atol=1e-6) for n in LOCAL)


def test_resume_is_bit_identical_on_every_rank_and_each_rank_checkpoints_its_own_head(
        runs: dict[str, Any]) -> None:
    ckpt = runs["ckpt"]
    assert [p.name for p in ckpt] == ["step-000000003"]
    # the heads differ: each rank keeps its own (rank<r>/ keys); the shared parameters are one
    keys = set(read_metadata(ckpt[-1]).state_dict_metadata)
    assert {"rank0/model/head.weight", "rank1/model/head.weight", "model/fc0.weight"} <= keys
    assert "model/head.weight" not in keys and "rank1/model/fc0.weight" not in keys
    full = [runs["first"][r]["allreduce"] for r in range(2)]
    for rank in range(2):
        resumed = runs["second"][rank]["resumed"]
        assert runs["second"][rank]["resumed_summary"]["steps"] == STEPS
        bad = [n for n in full[rank] if not np.array_equal(full[rank][n], resumed[n])]
        assert bad == [], f"rank {rank}: resumed run differs in {bad}"
    assert (runs["second"][0]["resumed_summary"]["parameters_sha256_by_rank"]
            == runs["first"][0]["allreduce_summary"]["parameters_sha256_by_rank"])
    # the two ranks' checkpoints hold different heads and the same shared parameters
    states = runs["ckpt_state"]
    models = [_find_model_state(states[r]) for r in range(2)]
    assert not torch.equal(models[0]["head.weight"], models[1]["head.weight"])
    assert torch.equal(models[0]["fc0.weight"], models[1]["fc0.weight"])


def _find_model_state(state: Any) -> dict[str, torch.Tensor]:
    """The model's state dict inside a checkpoint (the entry holding ``head.weight``)."""
    if isinstance(state, dict):
        if "head.weight" in state:
            return state
        for v in state.values():
            found = _find_model_state(v)
            if found:
                return found
    return {}
