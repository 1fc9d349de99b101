"""ModelParallel pieces without processes: placement errors, schedules, DataStore, p2p headers."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paratrain.comm.context import WorkerInfo, default_workers
from paratrain.comm.p2p import (
    DataStore,
    DataStoreTransport,
    _header,
    _parse_header,
    message_tag,
    open_session,
)
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig
from paratrain.config.strategy import Partition
from paratrain.executors.model_parallel.plan import build_plan
from paratrain.executors.model_parallel.runtime import StageRuntime, segment_modules
from paratrain.executors.model_parallel.schedule import (
    gpipe,
    micro_batch_sizes,
    one_f_one_b,
    schedule,
    sequential,
    simulate,
    theoretical_bubble,
)
from paratrain.executors.model_parallel.validation import num_workers

NODES = ["flatten", "fc0", "act0", "fc1", "act1", "head"]
WORKERS = [WorkerInfo(0, "worker-0"), WorkerInfo(1, "w1", ("gpu",)), WorkerInfo(2, "w2", ("gpu", "big"))]


def _parts(*specs: tuple[list[str], dict[str, str]]) -> list[Partition]:
    return [Partition.model_validate({"node_ids": n, "target": t}) for n, t in specs]


# ----------------------------------------------------------------- placement


def test_plan_tag_first_worker_uncovered_on_rank0_and_segments() -> None:
    plan = build_plan(NODES, _parts((["fc0", "act0", "head"], {"Tag": "gpu"}),
                                    (["fc1"], {"WorkerId": "w2"})), WORKERS)
    assert [(s.rank, s.nodes) for s in plan.segments] == [
        (0, ("flatten",)), (1, ("fc0", "act0")), (2, ("fc1",)), (0, ("act1",)), (1, ("head",))]
    assert plan.last_rank == 1 and not plan.is_contiguous()
    assert [s.index for s in plan.segments_of(0)] == [0, 3]


@pytest.mark.parametrize(("parts", "path", "needle"), [
    ([], "strategy.partitions", "no partitions"),
    ([([], {"WorkerId": "w1"})], "strategy.partitions[0].node_ids", "partition 0 is empty"),
    ([(["fc0"], {"WorkerId": "w1"}), (["act0", "fc0"], {"WorkerId": "w2"})],
     "strategy.partitions[1].node_ids", "'fc0' is claimed by partitions 0 and 1"),
    ([(["fc0", "fc0"], {"WorkerId": "w1"})], "strategy.partitions[0].node_ids", "listed twice"),
    ([(["fc9"], {"WorkerId": "w1"})], "strategy.partitions[0].node_ids",
     "claims 'fc9', which is not in this model; its nodes are: flatten, fc0"),
    ([(["fc0"], {"WorkerId": "nope"})], "strategy.partitions[0].target.WorkerId",
     "no worker with id 'nope'; registered ids: worker-0, w1, w2"),
    ([(["fc0"], {"Tag": "tpu"})], "strategy.partitions[0].target.Tag",
     "no worker carries tag 'tpu'; registered tags: big, gpu"),
])
def test_plan_errors_name_the_culprit(parts: list, path: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_plan(NODES, _parts(*parts), WORKERS)
    assert any(p == path and needle in m for p, m in info.value.problems), info.value.problems


def test_pipeline_needs_contiguous_runs() -> None:
    parts = _parts((["fc0", "act0"], {"WorkerId": "w1"}))  # rank 0 keeps flatten and fc1..head
    build_plan(NODES, parts, WORKERS)  # fine for Direct
    with pytest.raises(ConfigError, match=r"worker 'worker-0' \(rank 0\) owns 2 separate runs: "
                                          r"flatten; fc1,act1,head \(uncovered nodes run on rank 0\)"):
        build_plan(NODES, parts, WORKERS, contiguous=True)
    ok = build_plan(NODES, _parts((["fc1", "act1", "head"], {"Tag": "big"})), WORKERS, contiguous=True)
    assert [s.rank for s in ok.segments] == [0, 2]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_plan_segments_partition_the_graph(owners: list[int]) -> None:
    names = [f"n{i}" for i in range(len(owners))]
    workers = default_workers(4)
    parts = _parts(*[([n for n, o in zip(names, owners, strict=True) if o == r], {"WorkerId": f"worker-{r}"})
                     for r in range(1, 4) if r in owners])
    if not parts:
        return
    plan = build_plan(names, parts, workers)
    assert [n for s in plan.segments for n in s.nodes] == names
    assert all(a.rank != b.rank for a, b in zip(plan.segments, plan.segments[1:], strict=False))
    assert all(plan.owner[n] == o for n, o in zip(names, owners, strict=True))


def test_num_workers_from_job() -> None:
    def job(**kw: object) -> JobConfig:
        return JobConfig.model_validate({"strategy": {
            "type": "ModelParallel", "communication": {"protocol": "Direct"},
            "partitions": [{"node_ids": ["head"], "target": {"WorkerId": "worker-2"}}]}, **kw})
    assert num_workers(job()) == 3
    assert num_workers(job(workers=[{"id": "a"}, {"id": "worker-2"}])) == 2
    assert num_workers(job(run={"num_workers": 4})) == 4


# ----------------------------------------------------------------- schedules


def test_schedules_literal_orders() -> None:
    names = lambda order: [f"{k}{i}" for k, i, _ in order]  # noqa: E731
    assert names(one_f_one_b(0, 4, 3)) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert names(one_f_one_b(3, 4, 3)) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert names(one_f_one_b(1, 4, 6)) == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2",
                                           "F5", "B3", "B4", "B5"]
    assert names(gpipe(2, 4, 2)) == ["F0", "F1", "B0", "B1"]
    assert sequential([3, 0]) == [("F", 0, 0), ("F", 0, 3), ("B", 0, 3), ("B", 0, 0)]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        schedule("zb", 0, 2, 2)


@given(st.integers(1, 6), st.integers(1, 10), st.sampled_from(["GPipe", "1F1B"]))
def test_schedule_simulation(p: int, m: int, name: str) -> None:
    """Deadlock-free, every step once, ideal makespan 2(m+p-1), bubble (p-1)/(m+p-1),
    in-flight micro-batches m (GPipe) or min(p-s, m) (1F1B)."""
    orders = [schedule(name, s, p, m) for s in range(p)]
    for order in orders:
        assert sorted(order) == sorted([("F", i, order[0][2]) for i in range(m)] +
                                       [("B", i, order[0][2]) for i in range(m)])
    res = simulate(orders)
    assert res.makespan == 2 * (m + p - 1)
    assert res.bubble == pytest.approx(theoretical_bubble(p, m))
    want = [m] * p if name == "GPipe" else [min(p - s, m) for s in range(p)]
    assert res.peak_in_flight == want


@given(st.integers(1, 5), st.integers(1, 8), st.sampled_from(["GPipe", "1F1B"]),
       st.floats(0.5, 3.0), st.floats(0.5, 3.0))
def test_simulate_with_per_action_costs(p: int, m: int, name: str, f: float, b: float) -> None:
    """Per-action costs (a replay of measured times) agree with the uniform model when
    they are uniform; with stage 0 twice as slow its busy time doubles, bounds the
    makespan from below, and the step takes longer than the uniform one."""
    orders = [schedule(name, s, p, m) for s in range(p)]
    uniform = {a: (f if a[0] == "F" else b) for o in orders for a in o}
    assert simulate(orders, costs=uniform).makespan == pytest.approx(simulate(orders, t_f=f, t_b=b).makespan)
    slow0 = {a: c * (2 if a[2] == 0 else 1) for a, c in uniform.items()}
    res = simulate(orders, costs=slow0)
    assert res.busy[0] == pytest.approx(2 * m * (f + b))
    assert res.makespan >= res.busy[0]
    assert res.makespan > simulate(orders, costs=uniform).makespan


def test_simulate_detects_deadlock() -> None:
    bad = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 1), ("F", 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)  # type: ignore[arg-type]


@given(st.integers(1, 100), st.integers(1, 40))
def test_micro_batch_sizes(batch: int, mbs: int) -> None:
    sizes = micro_batch_sizes(batch, mbs)
    assert sum(sizes) == batch and all(s == mbs for s in sizes[:-1]) and 0 < sizes[-1] <= mbs


class _NoTransport:
    def send(self, *a: object, **k: object) -> None:
        raise AssertionError("a single-stage plan sends nothing")

    def recv(self, *a: object, **k: object) -> torch.Tensor:
        raise AssertionError("a single-stage plan receives nothing")

    def flush(self) -> None:
        pass


@given(st.integers(1, 20), st.integers(1, 8), st.sampled_from(["GPipe", "1F1B", None]))
def test_micro_batched_step_equals_full_batch(rows: int, mbs: int, sched: str | None) -> None:
    """sum_i sum_r CE / B over micro-batches = the batch mean: same loss and gradients."""
    torch.manual_seed(rows)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    x, y = torch.randn(rows, 5), torch.randint(0, 3, (rows,))
    ref = torch.nn.functional.cross_entropy(model(x), y)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    plan = build_plan(model, _parts((["0"], {"WorkerId": "worker-0"})), WORKERS)
    rt = StageRuntime(plan, 0, segment_modules(model, plan, 0), _NoTransport())
    loss = rt.train_step(x, y, step=0, micro_batch_size=mbs if sched else None, schedule_name=sched)
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    assert len(rt.stats.order) == 2 * (len(micro_batch_sizes(rows, mbs)) if sched else 1)


# ----------------------------------------------------------------- DataStore


def test_datastore_roundtrip_take_and_cleanup(tmp_path: Path) -> None:
    ds = DataStore(tmp_path, timeout_s=5)
    t = torch.randn(3, 4)
    ds.put("a-1", t)
    assert ds.keys() == ["a-1"]
    torch.testing.assert_close(ds.get("a-1"), t)
    torch.testing.assert_close(ds.take("a-1"), t)
    assert ds.keys() == [] and not list(tmp_path.iterdir())


def test_datastore_waits_for_a_late_producer_and_times_out(tmp_path: Path) -> None:
    ds = DataStore(tmp_path)
    threading.Timer(0.2, lambda: ds.put("late", torch.ones(2))).start()
    t0 = time.perf_counter()
    torch.testing.assert_close(ds.take("late", timeout_s=10), torch.ones(2))
    assert time.perf_counter() - t0 >= 0.15
    with pytest.raises(TimeoutError, match="'never' did not appear"):
        ds.get("never", timeout_s=0.1)


def test_datastore_rejects_bad_keys_pickles_and_oversize(tmp_path: Path) -> None:
    ds = DataStore(tmp_path, max_bytes=10_000)
    for key in ["../x", "a/b", "", ".hidden"]:
        with pytest.raises(ValueError, match="invalid datastore key"):
            ds.put(key, torch.zeros(1))
    torch.save({"obj": os.system}, tmp_path / "evil.pt")  # arbitrary pickle: refused
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        ds.get("evil")
    ds.put("big", torch.zeros(10_000))
    with pytest.raises(RuntimeError, match="over the limit"):
        ds.get("big")


def test_datastore_sessions_and_transport(tmp_path: Path) -> None:
    (tmp_path / "job.session-000000000000").mkdir()  # a stale session of an earlier launch
    (tmp_path / "other.session-000000000000").mkdir()  # another job sharing the directory
    ds = open_session(tmp_path, rank=0, namespace="job")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ds.root.name, "other.session-000000000000"])
    a, b = DataStoreTransport(ds, 0), DataStoreTransport(ds, 1)
    a.send(torch.arange(4.0), dst=1, key=("act", 2, 1), step=7)
    torch.testing.assert_close(b.recv(src=0, key=("act", 2, 1), step=7), torch.arange(4.0))
    a.close()
    assert not ds.root.exists()
    with pytest.raises(ValueError, match="namespace"):
        open_session(tmp_path, rank=0, namespace="../up")


# ----------------------------------------------------------------- p2p wire


@given(st.lists(st.integers(0, 5), max_size=6), st.sampled_from([torch.float32, torch.int64, torch.bfloat16]))
def test_p2p_header_roundtrip(shape: list[int], dtype: torch.dtype) -> None:
    t = torch.zeros(shape, dtype=dtype)
    assert _parse_header(_header(t), 1 << 20) == (dtype, tuple(shape))


def test_p2p_header_rejects_malformed() -> None:
    good = _header(torch.zeros(2, 3))
    for i, v, msg in [(0, 7, "magic"), (1, 99, "dtype"), (2, 11, "ndim"), (3, -1, "negative")]:
        h = good.clone()
        h[i] = v
        with pytest.raises(RuntimeError, match=msg):
            _parse_header(h, 1 << 20)
    with pytest.raises(RuntimeError, match="exceeds the limit"):
        _parse_header(_header(torch.zeros(100, 100)), 1000)
    assert len({message_tag((k, i, s)) for k in ("act", "grad", "metric", "eval")
                for i in range(5) for s in range(5)}) == 100
    with pytest.raises(ValueError, match="segment index"):
        message_tag(("act", 0, 10_000))


def test_example_job_places_three_stages() -> None:
    from paratrain.config.job import load_job
    from paratrain.executors.model_parallel.validation import plan_for
    from paratrain.models import build_model

    job = load_job(Path(__file__).resolve().parents[3] / "examples" / "model_parallel_pipeline.toml")
    model = build_model(job.model, input_shape=(64,), num_classes=10)
    plan = plan_for(job, model, default_workers(num_workers(job), list(job.workers)))
    assert [(s.rank, s.nodes) for s in plan.segments] == [
        (0, ("flatten", "fc0", "act0")), (1, ("fc1", "act1")), (2, ("head",))]
