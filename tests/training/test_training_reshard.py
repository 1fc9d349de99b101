"""Resume on another layout (paratrain.training.reshard): a checkpoint is keyed by the
model's own names, so DataParallel on 2 replicas resumes on 4 or 1, and a pipeline on 3
workers resumes on 2 or under another placement, continuing with the saved parameters
(and optimizer state); what cannot carry over is named in one warning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paratrain
from _reshard import fit_noting_reshards
from paratrain.files import step_folders
from paratrain.training.reshard import ReshardWarning, param_names
from paratrain.training.stores import Held, LocalStore, RankStore

pytestmark = pytest.mark.timeout(300)

REG = {"task": {"name": "regression"}, "data": {"name": "diabetes"},
       "model": {"name": "mlp", "hidden": [16, 8]}}


def _dp(n: int) -> dict[str, Any]:
    return {"type": "DataParallel", "num_replicas": n, "aggregation": {"method": "AllReduce"}}


def _doc(out: Path, strategy: dict[str, Any], steps: int, **extra: Any) -> dict[str, Any]:
    return {**REG, **extra, "strategy": strategy,
            "run": {"name": "r", "seed": 1, "output_dir": str(out), "checkpoint_every": 4,
                    **extra.pop("run", {})},
            "train": {"epochs": 3, "batch_size": 8, "max_steps": steps,
                      "optimizer": {"name": "adam", "lr": 0.01}}}


_fit = fit_noting_reshards


@pytest.mark.parametrize("after", [4, 1])
def test_data_parallel_resumes_on_another_replica_count(tmp_path: Path, after: int, capfd: pytest.CaptureFixture[str]) -> None:
    saved, _ = _fit(_doc(tmp_path, _dp(2), 8), capfd)
    run_dir = Path(saved["run_dir"])
    before = paratrain.load_model(run_dir)

    # zero steps left: the resumed model is exactly the saved one
    same, notes = _fit(_doc(tmp_path, _dp(after), 8), capfd, resume=True)
    assert same["parameters_sha256"] == saved["parameters_sha256"]
    assert notes and "'replicas': 2" in notes[0] and f"'replicas': {after}" in notes[0]
    assert all(torch.equal(before[k], v) for k, v in paratrain.load_model(run_dir).items())

    if after == 1:
        return  # training on after a reshard: the 4-replica case
    # and it trains on: 8 more steps on the new layout, from the saved optimizer state
    more, _ = _fit(_doc(tmp_path, _dp(after), 16), capfd, resume=True)
    assert more["steps"] == 16 and more["num_replicas"] == after
    assert more["test_loss"] < saved["test_loss"] * 1.5
    folders = step_folders(run_dir / "checkpoints")
    assert [p.name for p in folders] == ["step-000000012", "step-000000016"]  # the two newest
    assert json.loads((folders[-1] / "layout.json").read_text())["world"] == after


def test_dp_resharded_optimizer_state_is_the_saved_one(tmp_path: Path) -> None:
    """Non-vacuity of the optimizer half: Adam's moments read on another layout (another
    parameter order, by the model's names) are the checkpoint's."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    _save(tmp_path, model, opt, world=2)
    other = torch.nn.Sequential(torch.nn.Linear(3, 2))
    other_opt = torch.optim.Adam(reversed(list(other.parameters())))  # another order
    with pytest.warns(ReshardWarning, match="'replicas': 2"):
        found = LocalStore(tmp_path / "checkpoints").load(Held(other, other_opt, None, None))
    assert found is not None and found[1]["resharded"]
    other_opt.load_state_dict(found[1]["optimizer"])
    assert torch.equal(other_opt.state[other[0].bias]["exp_avg"], opt.state[model[0].bias]["exp_avg"])
    assert torch.equal(other_opt.state[other[0].weight]["exp_avg_sq"],
                       opt.state[model[0].weight]["exp_avg_sq"])


def _save(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, *, world: int) -> None:
    """``model``'s loop state as a DataParallel checkpoint of ``world`` replicas (written
    by one process, as its rank 0)."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": {},
             "rng": None, "step": 1, "epoch": 0, "batch": 1, "losses": [], "loader": {},
             "optimizer_type": "Adam", "layout": {"strategy": "DataParallel", "replicas": world},
             "names": list(model.state_dict()), "param_names": param_names(model, opt)}
    RankStore(run_dir, "dp", rank=0, world=1, group=None, layout={"replicas": world},
              layout_field="strategy.num_replicas").save(1, state)


def _pipe(placement: list[tuple[list[str], int]]) -> dict[str, Any]:
    return {"type": "ModelParallel",
            "communication": {"protocol": "Pipeline", "micro_batch_size": 4, "schedule": "1F1B"},
            "partitions": [{"node_ids": ids, "target": {"WorkerId": f"worker-{w}"}}
                           for ids, w in placement]}


@pytest.mark.parametrize("after", ["two-workers", "other-placement"])
def test_pipeline_resumes_on_fewer_workers_or_another_placement(tmp_path: Path, after: str, capfd: pytest.CaptureFixture[str]) -> None:
    three = _pipe([(["fc1", "act1"], 1), (["head"], 2)])
    new = (_pipe([(["fc1", "act1", "head"], 1)]) if after == "two-workers"
           else _pipe([(["fc0", "act0", "fc1"], 1), (["act1", "head"], 2)]))
    workers = 2 if after == "two-workers" else 3
    saved, _ = _fit(_doc(tmp_path, three, 8, run={"num_workers": 3}), capfd)
    same, notes = _fit(_doc(tmp_path, new, 8, run={"num_workers": workers}), capfd, resume=True)
    assert notes, "no reshard warning"
    before = paratrain.load_model(saved["run_dir"])
    now = paratrain.load_model(same["run_dir"])
    assert list(now) == list(before) and all(torch.equal(before[k], now[k]) for k in before)
    more, _ = _fit(_doc(tmp_path, new, 16, run={"num_workers": workers}), capfd, resume=True)
    assert more["steps"] == 16


@settings(max_examples=200, deadline=None)
@given(old=st.integers(1, 8), new=st.integers(1, 8), batch=st.integers(0, 60), per_epoch=st.integers(1, 40))
def test_the_new_position_repeats_what_rounding_down_drops_and_skips_nothing(
        old: int, new: int, batch: int, per_epoch: int) -> None:
    from paratrain.training.reshard import by_examples, repeated_batches

    walked = batch * old  # batches of batch_size rows the old replicas had trained on, together
    epoch, at = by_examples({"replicas": old}, {"replicas": new}, epoch=3, batch=batch, per_epoch=per_epoch)
    again = repeated_batches({"replicas": old}, {"replicas": new}, batch=batch, per_epoch=per_epoch)
    if epoch == 4:  # the old replicas had finished the epoch's share: the next epoch, nothing again
        assert at == 0 and again == 0 and walked // new >= per_epoch
    else:
        assert epoch == 3 and at * new <= walked  # nothing the old replicas had not trained on is skipped
        assert at * new + again == walked and 0 <= again < new
