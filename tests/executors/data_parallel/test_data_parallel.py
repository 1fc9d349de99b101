"""DataParallel on real gloo ranks: parity with single-process SGD on the concatenated
batch and with torch DDP; ParameterServer and Decentralized(complete) equal AllReduce;
gossip contracts; an unsynchronised run differs (non-vacuity)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _workers_dp import dp_job, dp_parity
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError
from paratrain.data import load_data
from paratrain.executors.data_parallel.runner import shard_indices, validate
from paratrain.models import build_model
from paratrain.training import build_optimizer, epoch_permutation, seed_everything

pytestmark = pytest.mark.timeout(300)

LOSSLESS = {"method": "TopK", "k": 1_000_000}  # k >= numel keeps every entry


def single_process_reference(job: Any, world: int) -> torch.Tensor:
    """SGD in one process on the concatenation of the replicas' batches."""
    seed_everything(job.run.seed)
    bundle = load_data(job.data, seed=job.run.seed)
    x, y = bundle.train.tensors
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    opt = build_optimizer(model.parameters(), job.train.optimizer)
    shards = [shard_indices(len(y), world=world, rank=r, seed=job.run.seed, epoch=0) for r in range(world)]
    bs = job.train.batch_size
    for b in range(job.train.max_steps):
        sel = torch.cat([s[b * bs : (b + 1) * bs] for s in shards])
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[sel]), y[sel]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def _t(v: Any) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def _check_parity(results: list[dict[str, Any]], world: int, tmp: Path) -> None:
    ref = single_process_reference(dp_job(str(tmp), "ref", world, {"method": "AllReduce"}), world)
    r0 = results[0]
    allreduce = _t(r0["AllReduce"]["params"])
    # Every replica ends with the same parameters...
    for r in results[1:]:
        assert torch.equal(_t(r["AllReduce"]["params"]), allreduce)
    # ...equal to single-process training on the concatenated batch,
    torch.testing.assert_close(allreduce, ref, rtol=1e-5, atol=1e-7)
    # ...and to torch DistributedDataParallel (rtol 1e-5; on one host our buckets are summed in
    # shared memory in rank order, gloo's ring sums in another order: atol for the rounding of
    # values near 0, bit for bit on 2 ranks, tests/comm/test_buckets_vs_ddp.py).
    torch.testing.assert_close(allreduce, _t(r0["DDP"]), rtol=1e-5, atol=1e-7 if world > 2 else 0.0)
    torch.testing.assert_close(_t(r0["ParameterServer"]["params"]), allreduce, rtol=1e-5, atol=1e-7)
    for r in results:
        torch.testing.assert_close(_t(r["complete"]["params"]), allreduce, rtol=1e-5, atol=1e-7)
    # Non-vacuity: independent replicas differ from the reference and from each other.
    nosync = [_t(r["NoSync"]["params"]) for r in results]
    assert (nosync[0] - ref).abs().max() > 1e-3
    assert (nosync[0] - nosync[1]).abs().max() > 1e-3
    ps = r0["ParameterServer"]["summary"]
    nbytes = 4 * r0["AllReduce"]["summary"]["num_parameters"]
    assert ps["server_bytes_per_step"] == pytest.approx(2 * (world - 1) * nbytes)


@pytest.mark.slow
def test_two_ranks_parity(tmp_path: Path) -> None:
    variants: list[tuple[Any, ...]] = [
        ("AllReduce", {"method": "AllReduce"}),
        ("DDP", None),
        ("ParameterServer", {"method": "ParameterServer"}),
        ("complete", {"method": "Decentralized", "topology": "complete"}),
        ("NoSync", None),  # independent replicas: the known-wrong variant
        # Lossless compression (TopK keeping everything) through the compressed paths.
        ("AllReduce_c", {"method": "AllReduce"}, {"compression": LOSSLESS}),
        ("ParameterServer_c", {"method": "ParameterServer"}, {"compression": LOSSLESS}),
        ("AllReduce_topk", {"method": "AllReduce"}, {"compression": {"method": "TopK", "k": 3}}),
    ]
    results = run_distributed(dp_parity, 2, str(tmp_path), variants, timeout_s=200)
    _check_parity(results, 2, tmp_path)
    allreduce = _t(results[0]["AllReduce"]["params"])
    for name in ("AllReduce_c", "ParameterServer_c"):
        for r in results:
            torch.testing.assert_close(_t(r[name]["params"]), allreduce, rtol=1e-5, atol=1e-7)
    # Lossy TopK: replicas still agree with each other, but not with dense AllReduce.
    topk = [_t(r["AllReduce_topk"]["params"]) for r in results]
    assert torch.equal(topk[0], topk[1])
    assert (topk[0] - allreduce).abs().max() > 1e-4
    stats = results[0]["AllReduce_topk"]["summary"]["compression"]
    assert stats["ratio"] < 0.5


@pytest.mark.slow
def test_four_ranks_parity_and_gossip(tmp_path: Path) -> None:
    variants: list[tuple[Any, ...]] = [
        ("AllReduce", {"method": "AllReduce"}),
        ("DDP", None),
        ("ParameterServer", {"method": "ParameterServer"}),
        ("complete", {"method": "Decentralized", "topology": "complete"}),
        ("ring", {"method": "Decentralized", "topology": "ring"}),
        ("torus", {"method": "Decentralized", "topology": "torus"}),
        ("NoSync", None),  # independent replicas: the known-wrong variant
        # CHOCO-gossip with lossless compression and gamma = 1 is plain gossip.
        ("choco_complete", {"method": "Decentralized", "topology": "complete"},
         {"compression": LOSSLESS, "comm": {"gossip_step": 1.0}}),
        # ErrorFeedback is dropped under CHOCO (double compensation diverges).
        ("choco_ring", {"method": "Decentralized", "topology": "ring"},
         {"compression": {"method": "ErrorFeedback", "error_compensation": True,
                          "base_strategy": {"method": "TopK", "k": 40}}}),
    ]
    results = run_distributed(dp_parity, 4, str(tmp_path), variants, timeout_s=250)
    _check_parity(results, 4, tmp_path)
    # Gossip pulls replicas together: after the same steps, ring/torus replicas are far
    # closer to each other than independent ones, and still not identical (ring != mean).
    nosync = torch.stack([_t(r["NoSync"]["params"]) for r in results])
    spread_nosync = float(torch.cdist(nosync, nosync).max())
    for topo in ("ring", "torus"):
        s = results[0][topo]["summary"]
        assert s["topology"] == topo
        assert 0.0 < s["consensus_distance_last"] < 0.5 * spread_nosync
        stacked = torch.stack([_t(r[topo]["params"]) for r in results])
        assert float(torch.cdist(stacked, stacked).max()) == pytest.approx(s["consensus_distance_last"], rel=1e-6)
    assert results[0]["complete"]["summary"]["consensus_distance_last"] < 1e-5
    allreduce = _t(results[0]["AllReduce"]["params"])
    for r in results:
        torch.testing.assert_close(_t(r["choco_complete"]["params"]), allreduce, rtol=1e-5, atol=1e-6)
    choco = results[0]["choco_ring"]["summary"]
    assert 0.0 < choco["consensus_distance_last"] < spread_nosync
    assert choco["compression"]["ratio"] < 0.5


@given(st.integers(1, 300), st.integers(1, 8), st.integers(0, 2**31), st.integers(0, 50))
def test_shards_disjoint_equal_and_local_batches(n: int, world: int, seed: int, epoch: int) -> None:
    if world > n:
        return
    parts = [shard_indices(n, world=world, rank=r, seed=seed, epoch=epoch) for r in range(world)]
    joined = torch.cat(parts)
    assert all(len(p) == n // world for p in parts)  # equal shards
    assert len(set(joined.tolist())) == len(joined) == (n // world) * world  # disjoint
    # A step's rows over all replicas are exactly Local's batch of world * bs rows (of
    # the permutation without its last n mod world rows).
    perm = epoch_permutation(n, seed=seed, epoch=epoch)[: (n // world) * world]
    bs = 3
    for b in range(0, n // world, bs):
        step_rows = sorted(torch.cat([p[b : b + bs] for p in parts]).tolist())
        assert step_rows == sorted(perm[b * world : (b + bs) * world].tolist())


def test_epoch_permutation_differs_by_epoch() -> None:
    n, world = 103, 4
    e0 = shard_indices(n, world=world, rank=0, seed=5, epoch=0)
    e1 = shard_indices(n, world=world, rank=0, seed=5, epoch=1)
    assert not torch.equal(e0, e1)
    assert torch.equal(e0, shard_indices(n, world=world, rank=0, seed=5, epoch=0))


def test_replica_count_errors(tmp_path: Path) -> None:
    job = dp_job(str(tmp_path), "x", 2000, {"method": "AllReduce"})
    with pytest.raises(ConfigError, match="strategy.num_replicas.*training rows"):
        validate(job, num_train=1347)
    with pytest.raises(ConfigError, match="num_replicas"):
        dp_job(str(tmp_path), "x", 0, {"method": "AllReduce"})
    with pytest.raises(ConfigError, match="ring, torus, complete"):
        dp_job(str(tmp_path), "x", 2, {"method": "Decentralized", "topology": "star"})


def test_a_checkpoint_of_the_earlier_per_process_format_is_a_clear_error(tmp_path: Path) -> None:
    """Another replica count is resumed by the model's names (tests/training/test_training_reshard.py
    runs it); a run folder whose newest checkpoint is of the per-process ``torch.save``
    format of earlier versions is not resumed: the error names the file and the setting."""
    import json

    from paratrain.comm.context import WorkerContext
    from paratrain.executors.data_parallel.runner import _store

    store = _store(WorkerContext(rank=0, world_size=1), tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "dp-complete.json").write_text(json.dumps({"step": 8, "replicas": 1}))
    with pytest.raises(ConfigError, match="dp-complete.json .*per-process torch.save format") as e:
        store.load()
    assert e.value.problems[0][0] == "strategy.num_replicas"


def test_error_feedback_is_dropped_under_decentralized(tmp_path: Path) -> None:
    from paratrain.executors.shared.replicas import build_compressor

    doc = {"method": "ClippedCompression", "clip_value": 1.0,
           "base_strategy": {"method": "ErrorFeedback", "error_compensation": True,
                             "base_strategy": {"method": "TopK", "k": 5}}}
    job = dp_job(str(tmp_path), "x", 2, {"method": "Decentralized", "topology": "ring"}, compression=doc)
    with pytest.warns(UserWarning, match="ErrorFeedback has no effect"):
        comp = build_compressor(job, validate(job).aggregation)
    assert comp.strategy.method == "ClippedCompression" and comp.strategy.base_strategy.method == "TopK"
    job = dp_job(str(tmp_path), "x", 2, {"method": "AllReduce"}, compression=doc)
    assert build_compressor(job, validate(job).aggregation).strategy.base_strategy.method == "ErrorFeedback"


def test_ineffective_settings_are_reported(tmp_path: Path) -> None:
    """The DataParallel-only [comm] fields are judged by effective_settings (which validate
    prints and run warns about once), not by a second check in the runner."""
    from paratrain.config.effective import effective_settings

    job = dp_job(str(tmp_path), "x", 2, {"method": "ParameterServer"},
                 comm={"gossip_step": 0.3, "bucket_size_mb": 4})
    fields = {i.field for i in effective_settings(job).ignored}
    assert fields == {"comm.gossip_step", "comm.bucket_size_mb"}
    job = dp_job(str(tmp_path), "x", 2, {"method": "AllReduce"}, comm={"bucket_size_mb": 4})
    assert effective_settings(job).ignored == []
