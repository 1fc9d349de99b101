"""ModelParallel on real gloo ranks: parity with the unpartitioned model for Direct,
Pipeline (GPipe, 1F1B; m < p, m = 1, uneven micro-batches) and DataStore on 2 and 3
processes (MLP, CNN, transformer), and the executed GPipe/1F1B step orders.

All cases of one world size run in one spawn (two spawns in total) to stay in budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_mp import batch, build, reference, run_cases
from paratrain.comm.testing import run_distributed
from paratrain.config.job import WorkerSpec
from paratrain.executors.model_parallel.schedule import micro_batch_sizes

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-7
MLP = {"model": "mlp", "model_kwargs": {"hidden": [32, 16]}}
# MLP nodes: flatten fc0 act0 fc1 act1 head
NONADJ = [  # rank 0: flatten, act1 (uncovered); rank 1: fc0 act0 + head; rank 2: fc1
    {"node_ids": ["fc0", "act0", "head"], "target": {"Tag": "gpu"}},
    {"node_ids": ["fc1"], "target": {"WorkerId": "w2"}},
]
PIPE3 = [  # rank 0: flatten fc0 act0 (uncovered); rank 1: fc1 act1; rank 2: head
    {"node_ids": ["fc1", "act1"], "target": {"Tag": "gpu"}},
    {"node_ids": ["head"], "target": {"WorkerId": "w2"}},
]
WORKERS3 = [WorkerSpec(id="worker-0"), WorkerSpec(id="w1", tags=["gpu"]), WorkerSpec(id="w2", tags=["gpu"])]


def _pipe(mbs: int, sched: str) -> dict[str, Any]:
    return {"protocol": "Pipeline", "micro_batch_size": mbs, "schedule": sched}


def _cases3(tmp: str) -> list[dict[str, Any]]:
    return [
        dict(MLP, seed=1, rows=12, partitions=NONADJ, communication={"protocol": "Direct"}),
        dict(MLP, seed=2, rows=10, partitions=PIPE3, communication=_pipe(4, "1F1B")),   # 4,4,2
        dict(MLP, seed=3, rows=10, partitions=PIPE3, communication=_pipe(3, "GPipe")),  # 3,3,3,1
        dict(MLP, seed=4, rows=5, partitions=PIPE3, communication=_pipe(4, "1F1B")),    # m=2 < p
        dict(MLP, seed=5, rows=7, partitions=PIPE3, communication=_pipe(16, "GPipe")),  # m=1
        dict(MLP, seed=6, rows=12, partitions=NONADJ, communication={"protocol": "DataStore"},
             datastore_dir=tmp),
        dict(MLP, seed=7, rows=16, partitions=PIPE3, communication=_pipe(4, "1F1B")),   # order
        dict(MLP, seed=7, rows=16, partitions=PIPE3, communication=_pipe(4, "GPipe")),  # order
        dict(MLP, seed=8, rows=3, partitions=PIPE3, communication=_pipe(8, "1F1B")),    # m=1
        dict(MLP, seed=9, rows=7, partitions=PIPE3, communication=_pipe(5, "GPipe")),   # 5,2: m < p
        # 10, 11: third step of a runtime, receives posted ahead (uneven; m < p)
        dict(MLP, seed=10, rows=10, partitions=PIPE3, communication=_pipe(3, "1F1B"), steps=3),
        dict(MLP, seed=11, rows=7, partitions=PIPE3, communication=_pipe(5, "GPipe"), steps=3),
    ]


CNN = {"model": "cnn", "model_kwargs": {"channels": [4, 8]}}
CNN_SPLIT = [{"node_ids": ["conv1", "act1", "pool1", "flatten", "head"], "target": {"WorkerId": "worker-1"}}]
TFM = {"model": "transformer", "model_kwargs": {"d_model": 16, "heads": 2, "layers": 2}}
TFM_SPLIT = [{"node_ids": ["block1", "pool", "head"], "target": {"WorkerId": "worker-1"}}]


def _cases2(tmp: str) -> list[dict[str, Any]]:
    return [
        dict(CNN, seed=11, rows=9, partitions=CNN_SPLIT, communication={"protocol": "Direct"}),
        dict(CNN, seed=12, rows=9, partitions=CNN_SPLIT, communication=_pipe(4, "1F1B")),
        dict(CNN, seed=13, rows=9, partitions=CNN_SPLIT, communication=_pipe(2, "GPipe")),
        dict(CNN, seed=14, rows=9, partitions=CNN_SPLIT, communication={"protocol": "DataStore"},
             datastore_dir=tmp),
        dict(TFM, seed=15, rows=6, partitions=TFM_SPLIT, communication=_pipe(4, "1F1B")),
        dict(CNN, seed=16, rows=9, partitions=CNN_SPLIT, communication=_pipe(2, "1F1B"), steps=3),
    ]


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    cases = _cases3(str(tmp_path_factory.mktemp("ds3")))
    return cases, run_distributed(run_cases, 3, cases, workers=WORKERS3, timeout_s=120)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    cases = _cases2(str(tmp_path_factory.mktemp("ds2")))
    return cases, run_distributed(run_cases, 2, cases, timeout_s=120)


def _check_parity(case: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    x, y = batch(case["rows"])
    ref_loss, ref_grads = reference(case, x, y)
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(losses) == 1, "exactly one rank (the last stage) computes the loss"
    assert losses[0] == pytest.approx(ref_loss, rel=RTOL)
    seen: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for k, g in r["grads"].items():
            assert k not in seen, f"{k} computed on two ranks"
            seen[k] = torch.from_numpy(g)
    assert set(seen) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(seen[k], g, rtol=RTOL, atol=ATOL, msg=f"gradient of {k}")
    logits = [r["logits"] for r in per_rank if r["logits"] is not None]
    assert len(logits) == 1
    torch.testing.assert_close(torch.from_numpy(logits[0]), build(case)(x).detach(),
                               rtol=RTOL, atol=ATOL)
    for r in per_rank:  # every DataStore value was consumed and its session removed
        if r["store_dir"] is not None:
            d = Path(r["store_dir"])
            assert not d.exists() or not list(d.iterdir())
            assert d.parent.is_dir()


@pytest.mark.parametrize("i", [0, 1, 2, 3, 4, 5, 8, 9, 10, 11])
def test_parity_three_ranks(three: Any, i: int) -> None:
    cases, results = three
    _check_parity(cases[i], [results[r][i] for r in range(3)])


@pytest.mark.parametrize("i", range(6))
def test_parity_two_ranks(two: Any, i: int) -> None:
    cases, results = two
    _check_parity(cases[i], [results[r][i] for r in range(2)])


@pytest.mark.parametrize(("world", "i"), [(3, 10), (3, 11), (2, 5)])
def test_later_steps_post_receives_ahead(three: Any, two: Any, world: int, i: int) -> None:
    """Non-vacuity for the multi-step parity cases: every stage (each receives
    activations, gradients or both) posted receives ahead, so the exact gradients
    above came through pre-posted buffers."""
    _, results = three if world == 3 else two
    assert all(results[r][i]["posted"] > 0 for r in range(world))


def test_nonadjacent_placement_really_split(three: Any) -> None:
    _, results = three
    assert [results[r][0]["segments"] for r in range(3)] == [[0, 3], [1, 4], [2]]


def test_non_vacuity_wrong_micro_batch_loss_scaling(three: Any) -> None:
    """Summing per-micro-batch *means* (a common bug) gives different gradients."""
    cases, results = three
    case = cases[2]
    x, y = batch(case["rows"])
    model = build(case)
    start = 0
    for n in micro_batch_sizes(case["rows"], case["communication"]["micro_batch_size"]):
        torch.nn.functional.cross_entropy(model(x[start:start + n]), y[start:start + n]).backward()
        start += n
    wrong = model.get_submodule("fc0").weight.grad
    assert isinstance(wrong, torch.Tensor)
    got = next(torch.from_numpy(r[2]["grads"]["fc0.weight"]) for r in results
               if "fc0.weight" in r[2]["grads"])
    assert not torch.allclose(wrong, got, rtol=RTOL, atol=ATOL)


EXPECTED_1F1B = [  # p = 3, m = 4 (PipeDream-Flush): warm-up p-s-1 forwards
    ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
    ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
    ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
]
EXPECTED_GPIPE = [["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]] * 3


@pytest.mark.parametrize(("i", "expected"), [(6, EXPECTED_1F1B), (7, EXPECTED_GPIPE)])
def test_schedule_order_and_dependencies(three: Any, i: int, expected: list[list[str]]) -> None:
    cases, results = three
    _check_parity(cases[i], [results[r][i] for r in range(3)])
    traces = {}
    for r in range(3):
        order = results[r][i]["order"]
        assert [f"{k}{m}" for k, m, _ in order] == expected[r]
        for k, m, s, t0, t1 in results[r][i]["trace"]:
            traces[(k, m, s)] = (t0, t1)
    # Executed timestamps (CLOCK_MONOTONIC, shared by processes) respect the data flow.
    for (k, m, s), (t0, _) in traces.items():
        if k == "F" and s > 0:
            assert t0 >= traces[("F", m, s - 1)][1]
        if k == "B" and s < 2:
            assert t0 >= traces[("B", m, s + 1)][1]


def test_one_f_one_b_holds_fewer_activations(three: Any) -> None:
    _, results = three
    peak_1f1b = results[0][6]["peak"]
    peak_gpipe = results[0][7]["peak"]
    assert 0 < peak_1f1b < peak_gpipe
