"""Issue 21 item 2: streams (``IterableDataset``) train through torchdata's
StatefulDataLoader, sharded over ranks and loader workers, counting steps, resumable
(paratrain.data.loader).

* sharding: two ranks read disjoint items that together are the stream's first items, in
  the same batches for 0 and 2 loader workers; a loader's ``state_dict`` restores the
  position exactly (the next batches are the uninterrupted ones);
* Local: a run cut at step 5 and resumed ends with the uninterrupted run's parameters
  (0 and 2 workers, and resumed with another worker count); dropping the position does
  not (non-vacuity);
* DataParallel x2 with batch 4 per replica trains Local's batches of 8 (each rank its own
  half of the items) and resumes exactly;
* a stream without ``train.max_steps``, or under Federated, is a ConfigError naming the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from _data_tasks import Stream
from paratrain.config import ConfigError
from paratrain.data.loader import LoaderOptions, StreamFeed
from paratrain.training.stores import LocalStore, latest_folder, read_rank_state

pytestmark = [pytest.mark.timeout(300)]
DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}


def _ids(feed: StreamFeed, n: int, start: int = 0) -> list[list[int]]:
    it = feed.batches(0, start)
    return [next(it)[2].tolist() for _ in range(n)]


def _feed(rank: int, world: int, workers: int) -> StreamFeed:
    return StreamFeed(Stream(None), batch_size=4, rank=rank, world=world, to_device=lambda b: b,
                      options=LoaderOptions(num_workers=workers, seed=1))


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_read_disjoint_items_in_the_same_batches_for_any_worker_count(workers: int) -> None:
    feeds = [_feed(r, 2, workers) for r in (0, 1)]
    try:
        got = [_ids(f, 5) for f in feeds]
        assert got[0] == [[(4 * k + i) * 2 for i in range(4)] for k in range(5)]
        flat = [set(sum(g, [])) for g in got]
        assert not flat[0] & flat[1] and flat[0] | flat[1] == set(range(40))
        # the position: a new loader given this one's state goes on where it stopped
        state = feeds[0].state_dict()
        assert _ids(feeds[0], 2) == [[(4 * k + i) * 2 for i in range(4)] for k in (5, 6)]
        again = _feed(0, 2, workers)
        again.load_state_dict(state)
        assert _ids(again, 2) == [[(4 * k + i) * 2 for i in range(4)] for k in (5, 6)]
        again.close()
    finally:
        for f in feeds:
            f.close()


def _job(tmp_path: Path, name: str, workers: int, max_steps: int | None = 12,
         **extra: Any) -> dict[str, Any]:
    train: dict[str, Any] = {"batch_size": 8, "optimizer": {"name": "sgd", "lr": 0.2}}
    if max_steps is not None:
        train["max_steps"] = max_steps
    return {"run": {"name": name, "seed": 3, "output_dir": str(tmp_path)},
            "task": {"factory": "_data_tasks:make_task", "kind": "stream"},
            "data": {"num_workers": workers}, "train": train, **extra}


def _cut_and_resume(tmp_path: Path, name: str, workers: int, resume_workers: int,
                    cut: int, steps: int, **extra: Any) -> dict[str, Any]:
    paratrain.fit(_job(tmp_path, name, workers, max_steps=cut, **extra))
    return paratrain.fit(_job(tmp_path, name, resume_workers, max_steps=steps, **extra), resume=True)


def test_local_stream_resumes_exactly(tmp_path: Path) -> None:
    full = paratrain.fit(_job(tmp_path, "full", 0))
    assert full["steps"] == 12 and math.isfinite(full["test_mse"])
    assert paratrain.fit(_job(tmp_path, "full2", 2))["parameters_sha256"] == full["parameters_sha256"]
    for workers, again in ((0, 0), (2, 2), (2, 0)):
        resumed = _cut_and_resume(tmp_path, f"cut{workers}{again}", workers, again, 5, 12)
        assert resumed["steps"] == 12
        assert resumed["parameters_sha256"] == full["parameters_sha256"], (workers, again)
    # non-vacuity: the stream position matters
    paratrain.fit(_job(tmp_path, "lost", 0, max_steps=5))
    ckpts = tmp_path / "lost" / "checkpoints"
    path = latest_folder(ckpts)
    assert path is not None
    state = read_rank_state(path)
    state["batch"], state["loader"] = 0, {}
    state.pop("shards")
    LocalStore(ckpts).save(int(state["step"]), state)
    lost = paratrain.fit(_job(tmp_path, "lost", 0), resume=True)
    assert lost["parameters_sha256"] != full["parameters_sha256"]


def test_data_parallel_ranks_share_the_stream_and_resume(tmp_path: Path) -> None:
    local = paratrain.fit(_job(tmp_path, "local", 0, max_steps=6))
    half: dict[str, Any] = _job(tmp_path, "dp", 1, max_steps=6, strategy=DP)
    half["train"]["batch_size"] = 4
    dp = paratrain.fit(half)
    assert dp["steps"] == 6
    # each replica's 4 items are its half of Local's batch of 8: the same mean gradient
    assert dp["test_mse"] == pytest.approx(local["test_mse"], rel=1e-4)
    cut = _job(tmp_path, "dpcut", 1, max_steps=3, strategy=DP)
    cut["train"]["batch_size"] = 4
    paratrain.fit(cut)
    cut["train"]["max_steps"] = 6
    resumed = paratrain.fit(cut, resume=True)
    assert resumed["parameters_sha256"] == dp["parameters_sha256"]


def test_stream_job_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        paratrain.fit(_job(tmp_path, "nosteps", 0, max_steps=None))
    assert [p[0] for p in e.value.problems] == ["train.max_steps"]
    fed = {"type": "Federated", "num_clients": 2, "rounds": 1, "aggregation": {"method": "FedAvg"},
           "client_selection": {"method": "All"}}
    with pytest.raises(ConfigError) as e:
        paratrain.fit(_job(tmp_path, "fed", 0, strategy=fed))
    assert "strategy.type" in [p[0] for p in e.value.problems]


def test_an_endless_stream_is_refused_nowhere_a_finite_one_ends_the_run(tmp_path: Path) -> None:
    doc = _job(tmp_path, "short", 0, max_steps=50)
    doc["task"]["length"] = 8 * 7 + 3  # 7 full batches, a partial one dropped
    summary = paratrain.fit(doc)
    assert summary["steps"] == 7 and math.isfinite(summary["test_mse"])
    assert torch.isfinite(torch.tensor(summary["test_mse"]))
