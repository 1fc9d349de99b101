"""Membership schedules under ``[fault_tolerance]`` (issue 37), with real replica groups on
torchft and a real Lighthouse, groups SIGKILLed at chosen steps (``PARATRAIN_FAULT_KILL``,
several ``RANK:STEP`` pairs):

* with ``replay = true`` the parameters equal a one-process reference in plain torch (SGD
  with momentum, each step the mean of every replica's gradient on its batch of that step,
  the batches cut from paratrain's shard order), over random schedules of which groups die
  after which steps and whether they are restarted and rejoin (hypothesis);
* the reference is not vacuous: without replay a lost group's shard goes untrained and the
  parameters end far from it;
* elastic membership: a group joins, another leaves, and the checkpoint written after the
  change, resumed by the same membership, ends bit-identically (parameters, momentum) to the
  run continued without stopping.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fault_tolerance import _job, _params, run_and_join
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from torch.utils.data import TensorDataset

from paratrain.comm.ft import lighthouse
from paratrain.config import load_job
from paratrain.config.job import JobConfig
from paratrain.data.loader import seed_everything
from paratrain.executors.data_parallel import fault_tolerance as ft
from paratrain.executors.data_parallel import runner as dp
from paratrain.task import resolve_task
from paratrain.training.stores import read_rank_state

pytestmark = [pytest.mark.timeout(600)]


def _membership_job(tmp: Path, name: str, *, replicas: int, steps: int, ft_table: dict[str, Any],
                    **run: Any) -> JobConfig:
    """``_job`` (SGD lr 0.1, momentum 0.9, 16 rows a replica's batch, digits) on ``replicas``
    shards for ``steps`` steps."""
    doc = _job(tmp, name, ft_table=ft_table, **run).to_json_dict()
    doc["strategy"]["num_replicas"] = replicas
    doc["train"].update(max_steps=steps, epochs=100)
    return load_job(doc)


def _reference(job: JobConfig, steps: int | None = None) -> dict[str, torch.Tensor]:
    """The job's parameters after ``steps`` (default: all) failure-free steps, in one process
    and plain torch: step ``k`` averages the gradients of every replica's batch ``k``, replica
    ``r``'s batches cut in order from its shard of the epoch (``shard_indices``, as the runner's)."""
    seed, t, n = job.run.seed, job.train, dp.validate(job).num_replicas
    seed_everything(seed)  # as a replica group, before it reads the data and builds the model
    task = resolve_task(job)
    train, _ = task.datasets(seed)
    model = task.build_model(job.model, train)
    assert isinstance(train, TensorDataset) and t.max_steps is not None
    x, y = train.tensors
    opt = torch.optim.SGD(model.parameters(), lr=t.optimizer.lr, momentum=float(t.optimizer.kwargs["momentum"]))
    rows, size = len(x), t.batch_size
    per_epoch = math.ceil(rows // n / size)  # the last batch of an epoch may be short
    for step in range(t.max_steps if steps is None else steps):
        epoch, b = divmod(step, per_epoch)
        opt.zero_grad()
        for r in range(n):
            idx = dp.shard_indices(rows, world=n, rank=r, seed=seed, epoch=epoch)[b * size:(b + 1) * size]
            (F.cross_entropy(model(x[idx]), y[idx]) / n).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_close_to(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():  # the sums' order differs (the groups' all-reduce, replayed shards)
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6)


@dataclass(frozen=True)
class Schedule:
    """``replicas`` groups (one per shard) train ``steps`` steps; group ``g`` of ``deaths``
    dies after its step; ``restart``: each dead group is restarted once and heals from a live
    peer (else it is gone for good)."""

    replicas: int
    steps: int
    deaths: tuple[tuple[int, int], ...]
    restart: bool


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    n, steps, restart = draw(st.integers(2, 3)), draw(st.integers(12, 24)), draw(st.booleans())
    # one group at least dies and one lives throughout (a restarted group may find its peers
    # done and the run ended, nothing left to heal from: the group that took the last step writes)
    dying = draw(st.sets(st.sampled_from(range(n)), min_size=1, max_size=n - 1))
    return Schedule(n, steps, tuple((g, draw(st.integers(1, steps - 1))) for g in sorted(dying)), restart)


def _run_schedule(tmp: Path, s: Schedule) -> tuple[JobConfig, dict[str, Any]]:
    job = _membership_job(tmp, "schedule", replicas=s.replicas, steps=s.steps,
                          ft_table={"min_replicas": 1, "replay": True}, max_restarts=int(s.restart))
    with pytest.MonkeyPatch.context() as mp:
        if s.deaths:
            mp.setenv(dp.FAULT_ENV, ",".join(f"{g}:{k}" for g, k in s.deaths))
        else:
            mp.delenv(dp.FAULT_ENV, raising=False)
        return job, ft.run(job)


@settings(max_examples=3, deadline=None)
@example(schedule=Schedule(3, 20, ((1, 4), (2, 11)), restart=True))  # two groups die, each restarted, each heals
@example(schedule=Schedule(3, 16, ((0, 5), (1, 9)), restart=False))  # groups 0 then 1 gone: group 2 trains all
@example(schedule=Schedule(2, 12, ((0, 11),), restart=True))  # group 0 restarted as its peer takes the last step
@given(schedule=schedules())
def test_replay_equals_a_one_process_reference(tmp_path_factory: pytest.TempPathFactory,
                                               schedule: Schedule) -> None:
    job, summary = _run_schedule(tmp_path_factory.mktemp("schedule"), schedule)
    dead = dict(schedule.deaths)
    assert summary["steps"] == schedule.steps
    faults = summary["fault_tolerance"]
    assert faults["restarts"] == [int(schedule.restart and g in dead) for g in range(schedule.replicas)]
    digests = faults["parameters_sha256_by_replica"]
    if not schedule.restart:  # a group gone for good leaves no record
        assert [g for g, d in enumerate(digests) if d is None] == sorted(dead)
    # every group that finished (a restarted one may find the run ended) holds the model written
    assert {d for d in digests if d is not None} == {summary["parameters_sha256"]}
    _assert_close_to(_params(summary["run_dir"]), _reference(job))


def test_the_reference_is_not_vacuous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # without replay group 1's shard of steps 4..12 is never trained: the parameters end far
    # from the reference (which moved far from the initial ones), beyond its tolerance
    monkeypatch.setenv(dp.FAULT_ENV, "1:3")
    job = _membership_job(tmp_path, "no-replay", replicas=2, steps=12, ft_table={"min_replicas": 1},
                          max_restarts=0)
    got, want, start = _params(ft.run(job)["run_dir"]), _reference(job), _reference(job, 0)

    def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    assert gap(got, want) > 1e-3 and gap(want, start) > 1e-2
    with pytest.raises(AssertionError):
        _assert_close_to(got, want)


def _state_tensors(folder: Path) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Group 0's position and its model and optimizer tensors in checkpoint ``folder``."""
    state = read_rank_state(folder, 0)
    leaves = pytree.tree_leaves({"model": state["model"], "optimizer": state["optimizer"]})
    return ({k: state[k] for k in ("step", "epoch", "batch")},
            [t for t in leaves if isinstance(t, torch.Tensor)])


def test_a_checkpoint_after_a_membership_change_resumes_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # run A: 3 shards, groups 0 and 1 started, replay; group 2 joins once training logged;
    # group 1 leaves for good after step 12 and min_replicas = 2 holds group 0 at step 13
    # until group 2 is in: the membership is {0, 2} from step 13 on. Group 0 checkpoints every
    # 12 steps (24 and 36 kept); epoch 0 ends at step 29 (449 rows a shard)
    monkeypatch.setenv(dp.FAULT_ENV, "1:12")
    job = _membership_job(tmp_path / "a", "elastic", replicas=3, steps=36, max_restarts=0, checkpoint_every=12,
                          log_every=4, ft_table={"min_replicas": 2, "groups": 2, "replay": True})
    a, joined = run_and_join(job, 2, timeout_s=300)
    monkeypatch.delenv(dp.FAULT_ENV)
    assert a["steps"] == 36 and a["fault_tolerance"]["parameters_sha256_by_replica"][1] is None
    # group 2 came in by step 12: healed from a live peer, or read group 0's checkpoint of
    # step 12 while group 0 waited there for a quorum (then no peer was ahead of it)
    assert joined is not None and joined["parameters_sha256"] == a["parameters_sha256"]
    assert joined["resumed_from"]["checkpoint"] in ("a live peer", "step-000000012")
    assert joined["resumed_from"]["step"] <= 12
    a_dir = Path(a["run_dir"])
    changes = [r["step"] for r in map(json.loads, (a_dir / "metrics.jsonl").read_text().splitlines())
               if "groups" in r]
    assert max(changes) <= 13  # no change of the quorum's size after step 13
    # run B: A's folder as it stood after step 24 (step 36's checkpoint and the records of
    # the end dropped), resumed by groups 0 and 2 alone, each `paratrain run --join-group G`
    # (which resumes) against a Lighthouse of min_replicas = 2: the membership {0, 2} again
    b_dir = tmp_path / "b" / "elastic"
    shutil.copytree(a_dir, b_dir, ignore=shutil.ignore_patterns(
        "step-000000036", "replica-*.json", ".replica-*", "summary.json", "model.safetensors", ".lock"))
    with lighthouse(min_replicas=2, join_timeout_s=0.5, heartbeat_timeout_s=2.0) as address:
        doc = job.to_json_dict()
        doc["run"]["output_dir"] = str(tmp_path / "b")
        doc["fault_tolerance"]["lighthouse"] = address.removeprefix("http://")
        resumed = load_job(doc)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            records = list(pool.map(lambda g: ft.join_group(resumed, g), [0, 2]))
    for record in records:
        assert record is not None and record["resumed_from"]["checkpoint"] == "step-000000024"
        assert record["steps"] == 36 and record["parameters_sha256"] == a["parameters_sha256"]
    (a_pos, a_tensors), (b_pos, b_tensors) = (_state_tensors(d / "checkpoints" / "step-000000036")
                                              for d in (a_dir, b_dir))
    assert a_pos == b_pos == {"step": 36, "epoch": 1, "batch": 7}
    assert len(a_tensors) == len(b_tensors) > 4  # the model's and the momentum buffers
    assert all(torch.equal(p, q) for p, q in zip(a_tensors, b_tensors, strict=True))
