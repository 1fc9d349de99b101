"""ZeRO x tensor parallelism on one mesh: 4 gloo ranks laid out ``dp 2 x tp 2``
(rank = dp*2 + tp), ZeRO-1/2/3 over the dp columns on each TP shard, against the
unpartitioned Local model on the same rows (2 replicas x 8 rows = Local's 16):

* the step-0 gradients every rank owns assemble the Local model's gradients (rtol 1e-5;
  also ZeRO-2 under sequence parallelism, ``rs-gradients``),
  and the norm the engine clips by is the Local model's ``clip_grad_norm_`` (one global
  norm over the composition; the naive sum over ranks, which counts the replicated head
  twice, is not);
* 4 steps with clipping active, SGD (momentum, weight decay) and AdamW, at every level:
  the losses per step and the parameters equal Local's (rtol 1e-5);
* a ZeRO-3 run stopped at step 2 and resumed on the same mesh ends bit-identical to the
  uninterrupted one;
* ``validate`` / ``graph`` state the mesh (rank layout, groups) and what ZeRO shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_mesh import LEVELS, OPTIMIZERS, first_batch, mesh_job, mesh_worker
from paratrain.comm.testing import run_distributed
from paratrain.training import read_metrics

pytestmark = [pytest.mark.timeout(300)]

REPLICATED = {"fc1.bias", "head.weight", "head.bias"}  # whole on both ranks of a TP group
CLIP = 0.1  # the step-0 gradient norm is about 0.33: clipping scales every step


def _cases() -> list[tuple[str, dict[str, Any], bool]]:
    cases: list[tuple[str, dict[str, Any], bool]] = [
        (f"{lvl}-{opt}", {"shard": lvl, "optimizer": opt, "clip": CLIP}, False)
        for opt in OPTIMIZERS for lvl in LEVELS]
    resume = {"shard": "parameters", "clip": CLIP, "checkpoint_every": 2}
    cases += [("full", resume, False), ("split", {**resume, "steps": 2}, False), ("split", resume, True)]
    return cases


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 4 processes: the step-0 gradients at each level (2 micro-batches,
    the default memory_optimization's recomputation), then every job."""
    tmp = str(tmp_path_factory.mktemp("mesh"))
    ranks = run_distributed(mesh_worker, 4, tmp, _cases(), timeout_s=280)
    return {"tmp": tmp, "ranks": ranks}


def _initial(tmp: str) -> dict[str, torch.Tensor]:
    from paratrain.training import seed_everything

    job = mesh_job(tmp, "init", shard="none", dp=1, tp=1, batch=16)
    seed_everything(job.run.seed)
    task, train, _ = first_batch(job, dp=1, replica=0)
    return {k: v.detach() for k, v in task.build_model(job.model, train).state_dict().items()}


def _local_step0(tmp: str) -> tuple[dict[str, torch.Tensor], float]:
    from paratrain.task.steps import call_model
    from paratrain.training import seed_everything

    job = mesh_job(tmp, "ref", shard="none", dp=1, tp=1, batch=16)
    seed_everything(job.run.seed)
    task, train, batch = first_batch(job, dp=1, replica=0)
    model = task.build_model(job.model, train)
    task.loss(call_model(task, model, batch), batch).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    return grads, float(norm)


def _assemble(ranks: list[dict[str, Any]], level: str, like: dict[str, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    dense = {n: torch.full_like(g, float("nan")) for n, g in like.items()}
    covered = dict.fromkeys(like, 0)
    for r in ranks:
        for name, (spec, g) in r["grads"][level]["pieces"].items():
            view = dense[name]
            for dim, start, length in (spec or {"slices": []})["slices"]:
                view = view.narrow(dim, start, length)
            view.copy_(g)
            covered[name] += g.numel()
    return dense, covered


def test_rank_layout_is_the_dp_x_tp_mesh(mesh_runs: dict[str, Any]) -> None:
    for rank, r in enumerate(mesh_runs["ranks"]):
        g = r["grads"]
        assert g["coords"] == {"dp": rank // 2, "tp": rank % 2}
        assert g["tp_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]  # a row: one model replica
        assert g["dp_ranks"] == [rank % 2, rank % 2 + 2]  # a column: the same TP shard
    s = mesh_runs["ranks"][0]["jobs"]["parameters-adamw"]
    assert s["mesh"]["layout"] == "rank = dp*2 + tp" and s["shard"] == "parameters"


@pytest.mark.parametrize("level", [*LEVELS, "rs-gradients"])
def test_step0_gradients_and_global_norm_equal_the_unpartitioned_model(
        mesh_runs: dict[str, Any], level: str) -> None:
    ref, norm = _local_step0(mesh_runs["tmp"])
    ranks = mesh_runs["ranks"]
    dense, covered = _assemble(ranks, level, ref)
    for name, g in ref.items():
        # every element owned once per copy: the replicated tensors (the row layer's bias,
        # the head) by both TP ranks, the column/row shards once
        assert covered[name] == g.numel() * (2 if name in REPLICATED else 1), name
        torch.testing.assert_close(dense[name], g, rtol=1e-5, atol=1e-7)
    assert norm > CLIP  # clipping is active in the runs below
    for r in ranks:
        assert r["grads"][level]["sq_norm"] ** 0.5 == pytest.approx(norm, rel=1e-5)
    # non-vacuity: summing every rank's squares counts the replicated head twice
    naive = sum(float(g.double().pow(2).sum()) for r in ranks
                for _, g in r["grads"][level]["pieces"].values())
    assert abs(naive ** 0.5 - norm) > 1e-3 * norm


def _params(path: Path) -> dict[str, torch.Tensor]:
    from paratrain.training.export import read_model

    return read_model(path / "model.safetensors")


def _losses(path: Path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(path)]  # eval_every = 1: the step's loss


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_parameters_and_losses_equal_local_after_4_clipped_steps(mesh_runs: dict[str, Any], opt: str) -> None:
    from paratrain.executors.local import run as run_local

    tmp = Path(mesh_runs["tmp"])
    run_local(mesh_job(str(tmp), f"local-{opt}", shard="none", dp=1, tp=1, batch=16, optimizer=opt,
                       clip=CLIP))
    ref, ref_loss = _params(tmp / f"local-{opt}"), _losses(tmp / f"local-{opt}")
    assert len(ref_loss) == 4
    for lvl in LEVELS:
        got = _params(tmp / f"{lvl}-{opt}")
        assert list(got) == list(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(_losses(tmp / f"{lvl}-{opt}")), torch.tensor(ref_loss),
                                   rtol=1e-5, atol=0)
    # non-vacuity: the 4 steps moved the parameters from the initial model
    init = _initial(str(tmp))
    assert max(float((ref[k] - init[k]).abs().max()) for k in ref) > 1e-3


def test_zero3_x_tp_resumes_bit_identically(mesh_runs: dict[str, Any]) -> None:
    jobs = mesh_runs["ranks"][0]["jobs"]
    assert jobs["full"]["steps"] == jobs["split"]["steps"] == 4
    assert jobs["full"]["parameters_sha256"] == jobs["split"]["parameters_sha256"]


def test_validate_and_graph_state_the_mesh(tmp_path: Path) -> None:
    from paratrain.executors.tensor_parallel.runner import mesh_lines
    from paratrain.explain import explain, render

    job = mesh_job(str(tmp_path), "v", shard="parameters")
    lines = mesh_lines(job)
    assert lines[0] == ("mesh dp 2 x tp 2: rank = dp*2 + tp; dp groups [[0, 2], [1, 3]]; "
                        "tp groups [[0, 1], [2, 3]]")
    assert "ZeRO (shard = parameters) over dp on each TP shard: ZeRO-3" in lines[1]
    assert "fc0 (" in lines[1] and "head (" in lines[1]
    text = render(explain(job))
    assert "mesh dp 2 x tp 2: rank = dp*2 + tp" in text and "tp groups: [0, 1] [2, 3]" in text
    assert "ZeRO-3 (shard = parameters) over 2 replicas" in text


def test_refused_compositions_are_config_errors_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pipeline x tensor parallelism with a protocol it does not run (DataStore) is refused by
    ``validate`` naming the field (before this, ModelParallel ran every stage unsharded
    with an ignored-setting warning); ZeRO x TP with compression is refused as DataParallel
    ZeRO is."""
    from paratrain.cli import main
    from paratrain.config import ConfigError, load_job
    from paratrain.dispatch import effective_settings
    from paratrain.executors.tensor_parallel.runner import layout

    examples = Path(__file__).resolve().parents[3] / "examples"
    doc = load_job(examples / "model_parallel_pipeline.toml").to_json_dict()
    doc["run"]["output_dir"] = str(tmp_path)
    doc["tensor_parallel"] = {"tensor_parallel_size": 2}
    doc["strategy"]["communication"] = {"protocol": "DataStore"}
    path = tmp_path / "mp_tp.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr()
    assert "strategy.communication.protocol: DataStore passes activations" in err.out + err.err
    assert not [i for i in effective_settings(load_job(doc), probe=False).ignored
                if str(i).startswith("tensor_parallel")]
    with pytest.raises(ConfigError, match="strategy.shard"):
        layout(mesh_job(str(tmp_path), "c", shard="gradients").model_copy(
            update={"compression": load_job({**doc, "compression": {"method": "TopK", "k": 3}}).compression}))
    # and the composition that runs: validate prints the mesh
    ok = tmp_path / "zero_tp.json"
    ok.write_text(json.dumps(mesh_job(str(tmp_path), "ok", shard="optimizer").to_json_dict()))
    assert main(["validate", str(ok)]) == 0
    assert "mesh dp 2 x tp 2: rank = dp*2 + tp" in capsys.readouterr().out


def test_optimizer_state_is_sharded_over_the_whole_mesh(mesh_runs: dict[str, Any]) -> None:
    """AdamW's moments a rank holds (measured from its tensors): a tensor-parallel shard's
    over the 4 ranks, a tensor the TP ranks hold whole over the 2 dp ranks (ZeRO over the
    dp column of each TP shard) -- not TP's alone (half of the sharded, all of the rest)."""
    sharded = 64 * 16 + 16 + 16 * 16  # fc0 (column), fc1.weight (row)
    replicated = 16 + 16 * 10 + 10  # fc1.bias, head
    want = 8 * (sharded / 4 + replicated / 2)
    tp_only = 8 * (sharded / 2 + replicated)
    for lvl in LEVELS:
        held = mesh_runs["ranks"][0]["jobs"][f"{lvl}-adamw"]["held_bytes"]
        assert abs(held["optimizer"] - want) <= 0.1 * want, (lvl, held, want)
        assert held["optimizer"] < 0.6 * tp_only
