"""Pipeline schedules GPipe, 1F1B, Interleaved1F1B and ZBH1 (issue 22 item 3).

Pure: each schedule is a per-rank list of F/B/W steps; hypothesis checks every step runs
once, F before B before W, no deadlock when replayed with the cross-rank dependencies,
and the replayed bubble equals the formulas ((p-1)/(m+p-1), (p-1)/(vm+p-1),
(p-1)/(3m+p-1) for m >= p) at no more in-flight micro-batches than 1F1B's peak.

Real: one 4-process gloo launch runs every schedule x m in {1, p-1, p, 2p+1} for p = 2
and 4 stages, two steps each, with a timeout (the soak: it must never hang); the second
step's loss and gradients equal the unpartitioned model's (a skip connection crossing
every stage and a weight tied across the first and last stage), ZBH1's split backward
equals 1F1B's full backward (rtol 1e-6) and each rank ran exactly its schedule's order.
In one process: B then W (backward_split) equals one backward() bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _workers_mp_sched import chunks, reference, run_cases
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError
from paratrain.config.strategy import load_strategy
from paratrain.executors.model_parallel.plan import build_plan, check_interleaved
from paratrain.executors.model_parallel.schedule import (
    SCHEDULES,
    interleaved_1f1b,
    micro_batch_sizes,
    one_f_one_b,
    schedule,
    simulate,
    theoretical_bubble,
    zb_h1,
)

RTOL, ATOL = 1e-5, 1e-7


def _orders(name: str, p: int, m: int, v: int = 1) -> list[list[Any]]:
    return [schedule(name, r, p, m, v) for r in range(p)]


def _sim(name: str, p: int, m: int, v: int = 1) -> Any:
    """Ideal replay: a stage's F and B take 1 (ZBH1: F = B = W = 1; 1F1B's B is B + W = 2
    when compared with it); an interleaved chunk's steps take 1/v."""
    if name == "ZBH1":
        return simulate(_orders(name, p, m), t_f=1, t_b=1, t_w=1)
    return simulate(_orders(name, p, m, v), t_f=1 / v, t_b=1 / v)


@given(st.sampled_from(SCHEDULES), st.integers(1, 6), st.integers(1, 14), st.integers(1, 4))
def test_orders_complete_ordered_deadlock_free(name: str, p: int, m: int, v: int) -> None:
    v = v if name == "Interleaved1F1B" else 1
    orders = _orders(name, p, m, v)
    kinds = "FBW" if name == "ZBH1" else "FB"
    for r, order in enumerate(orders):
        segs = sorted({s for _, _, s in order})
        assert segs == [r + c * p for c in range(v)]  # chunks round-robin
        assert sorted(order) == sorted((k, i, s) for k in kinds for i in range(m) for s in segs)
        at = {a: n for n, a in enumerate(order)}
        for i in range(m):
            for s in segs:
                assert at[("F", i, s)] < at[("B", i, s)]
                if name == "ZBH1":
                    assert at[("B", i, s)] < at[("W", i, s)]
    simulate(orders)  # raises on deadlock or a step depending on one nobody runs


@given(st.sampled_from(SCHEDULES), st.integers(2, 6), st.integers(1, 24), st.integers(2, 4))
def test_simulated_bubble_equals_formula(name: str, p: int, m: int, v: int) -> None:
    v = v if name == "Interleaved1F1B" else 1
    res = _sim(name, p, m, v)
    one = simulate(_orders("1F1B", p, m), t_f=1, t_b=2 if name == "ZBH1" else 1)
    if m >= p or name in ("GPipe", "1F1B"):
        assert res.bubble == pytest.approx(theoretical_bubble(p, m, name, v), abs=1e-12)
    assert res.bubble <= one.bubble + 1e-12  # never worse than 1F1B
    if name == "ZBH1":  # 1F1B's activation memory: its peak, on its first stage
        assert max(res.peak_in_flight) == max(one.peak_in_flight) == min(p, m)
    if name == "Interleaved1F1B":  # Megatron's warm-up, plus the first steady forward
        g = -(-m // max(1, m // p))  # the first (largest) micro-batch group
        assert res.peak_in_flight == [min(v * m, 2 * (p - r - 1) + (v - 1) * g + 1) for r in range(p)]


def test_zbh1_third_of_1f1b_bubble_and_literal_orders() -> None:
    """p = 4, m = 8, F = B = W: 1F1B idles 3(p-1) units a stage, ZB-H1 p-1; step 27 vs 33."""
    zb, one = _sim("ZBH1", 4, 8), simulate(_orders("1F1B", 4, 8), t_f=1, t_b=2)
    assert (zb.makespan, one.makespan) == (27, 33)
    assert [zb.makespan - b for b in zb.busy] == [3] * 4
    assert [one.makespan - b for b in one.busy] == [9] * 4
    names = lambda order: [f"{k}{i}.{s}" for k, i, s in order]  # noqa: E731
    assert names(zb_h1(1, 2, 3)) == ["F0.1", "B0.1", "F1.1", "B1.1", "W0.1", "F2.1", "B2.1", "W1.1", "W2.1"]
    assert names(zb_h1(0, 2, 3)) == ["F0.0", "F1.0", "B0.0", "W0.0", "F2.0", "B1.0", "W1.0", "B2.0", "W2.0"]
    # Megatron's warm-up 2(p-r-1) + (v-1)g: rank 0 holds every forward, rank 1 two
    assert names(interleaved_1f1b(0, 2, 2, 2)) == [
        "F0.0", "F1.0", "F0.2", "F1.2", "B0.2", "B1.2", "B0.0", "B1.0"]
    assert names(interleaved_1f1b(1, 2, 2, 2)) == [
        "F0.1", "F1.1", "F0.3", "B0.3", "F1.3", "B1.3", "B0.1", "B1.1"]
    assert interleaved_1f1b(1, 3, 5, 1) == one_f_one_b(1, 3, 5)
    with pytest.raises(RuntimeError, match="deadlock"):  # a W before its B never runs
        simulate([[("F", 0, 0), ("W", 0, 0), ("B", 0, 0)]])


def test_config_refusals_explain() -> None:
    part = [{"node_ids": ["a"], "target": {"WorkerId": "worker-0"}}]
    for comm, field in (({"protocol": "Direct", "virtual_stages": 2}, "virtual_stages"),
                        ({"protocol": "DataStore", "schedule": "ZBH1"}, "schedule"),
                        ({"protocol": "Pipeline", "micro_batch_size": 2, "schedule": "ZBH1",
                          "virtual_stages": 2}, "virtual_stages")):
        with pytest.raises(ConfigError, match=field):
            load_strategy({"type": "ModelParallel", "partitions": part, "communication": comm})
    from paratrain.comm.context import default_workers

    workers = default_workers(2, [])

    def plan(targets: list[int]) -> Any:
        s = load_strategy({"type": "ModelParallel", "communication": {"protocol": "Direct"}, "partitions": [
            {"node_ids": [n], "target": {"WorkerId": f"worker-{t}"}} for n, t in zip("abcd", targets, strict=True)]})
        return build_plan(list("abcd"), s.partitions, workers)

    assert check_interleaved(plan([0, 1, 0, 1]), workers, None) == 2
    assert check_interleaved(plan([0, 1, 0, 1]), workers, 2) == 2
    with pytest.raises(ConfigError, match=r"round-robin.*3 parts: worker-0: parts \[0, 2\]; worker-1: parts \[1\]"):
        check_interleaved(plan([0, 1, 1, 0]), workers, None)
    with pytest.raises(ConfigError, match="virtual_stages = 3"):
        check_interleaved(plan([0, 1, 0, 1]), workers, 3)


class _Branchy(torch.nn.Module):
    """A skip, a weight read twice, a branch reading weights only, a leaf from elsewhere,
    two Linears tied to one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.d = torch.nn.Linear(6, 6)
        self.d.weight = self.b.weight
        self.pos = torch.nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, remote: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.a(x)) + x
        h2 = self.b(h) * h + self.pos + torch.relu(self.d(h))
        h3 = (h2 @ self.a.weight.T) @ remote
        return self.c(h3), h2.sum(-1, keepdim=True) * self.pos.sum(), self.pos * 2


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("input_grad", [True, False])
def test_split_backward_equals_backward(input_grad: bool, micro_batches: int) -> None:
    """B then W (backward_split) gives exactly one backward()'s gradients, also accumulated
    over several micro-batches (W adds into the weights' existing .grad); B alone leaves
    every weight's .grad as it was (the weight work really is deferred)."""
    from paratrain.executors.model_parallel.backward_split import backward_inputs

    def run(split: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model, remote = _Branchy(), torch.randn(6, 6, requires_grad=True)
        got: dict[str, torch.Tensor] = {}
        for i in range(micro_batches):
            x = torch.randn(5, 6, requires_grad=input_grad)
            outs = model(x, remote)
            grads = [torch.randn_like(o) for o in outs]
            if split:
                before = [None if q.grad is None else q.grad.clone() for q in model.parameters()]
                w = backward_inputs(list(outs), grads, [x] if input_grad else [])
                after = [q.grad for q in model.parameters()]
                assert all((a is None) if b is None else torch.equal(a, b) for a, b in zip(after, before, strict=True))
                w.run()
            else:
                torch.autograd.backward(list(outs), grads)
            if input_grad:
                got[f"x{i}"] = x.grad
        got |= {k: q.grad.clone() for k, q in model.named_parameters()} | {"remote": remote.grad}
        return got

    full, split = run(False), run(True)
    assert set(full) == set(split)
    for k, g in full.items():
        assert g is not None and torch.equal(g, split[k]), k


def _cases() -> list[dict[str, Any]]:
    out = []
    for p in (2, 4):
        for name in SCHEDULES:
            for m in sorted({1, p - 1, p, 2 * p + 1}):
                out.append({"p": p, "schedule": name, "rows": 2 * m - 1, "mbs": 2, "seed": 10 * p + m,
                            "chunks": chunks(2 * p if name == "Interleaved1F1B" else p), "m": m,
                            "steps": 2})
    return out


@pytest.fixture(scope="module")
def ran() -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    cases = _cases()
    return cases, run_distributed(run_cases, 4, cases, timeout_s=150)


def test_soak_every_schedule_and_m_finishes(ran: Any) -> None:
    cases, results = ran
    assert {(c["p"], c["schedule"], c["m"]) for c in cases} == {
        (p, s, m) for p in (2, 4) for s in SCHEDULES for m in {1, p - 1, p, 2 * p + 1}}
    assert all(len(r) == len(cases) for r in results)


@pytest.mark.parametrize("i", range(28))
def test_parity_with_unpartitioned_model(ran: Any, i: int) -> None:
    cases, results = ran
    case = cases[i]
    p, name, m = case["p"], case["schedule"], case["m"]
    assert len(micro_batch_sizes(case["rows"], case["mbs"])) == m
    ref_loss, ref = reference(case["seed"], case["rows"])
    losses = [results[r][i]["loss"] for r in range(4) if results[r][i]["loss"] is not None]
    assert losses == [pytest.approx(ref_loss, rel=RTOL)]
    seen: dict[str, torch.Tensor] = {}
    for r in range(4):
        for k, g in results[r][i]["grads"].items():
            assert k not in seen, f"{k} has a gradient on two ranks"
            seen[k] = torch.from_numpy(g)
    assert set(seen) == set(ref)  # the tied embed.weight once, on its holder
    for k, g in ref.items():
        torch.testing.assert_close(seen[k], g, rtol=RTOL, atol=ATOL, msg=f"{name} m={m}: {k}")
    v = 2 if name == "Interleaved1F1B" else 1
    for r in range(p):  # each rank ran its schedule's order over its chunks
        res = results[r][i]
        assert res["parts"] == [r + c * p for c in range(v)] and res["v"] == v
        assert res["order"] == schedule(name, r, p, m, v)
    assert all(results[r][i]["order"] == [] for r in range(p, 4))
    if name == "ZBH1":  # the split backward equals the full one (1F1B, same micro-batches)
        j = next(k for k, c in enumerate(cases) if c["p"] == p and c["m"] == m and c["schedule"] == "1F1B")
        for r in range(p):
            for k, g in results[r][i]["grads"].items():
                torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(results[r][j]["grads"][k]),
                                           rtol=1e-6, atol=0)


def test_validate_interleaved_example_and_refusals(tmp_path: Any) -> None:
    """``paratrain validate``'s path (validation.validate) on the interleaved example: 2 workers
    x 2 chunks round-robin; the same job with ZBH1, or virtual_stages = 3, is refused."""
    from pathlib import Path

    from paratrain.config.job import load_job
    from paratrain.executors import import_plugins
    from paratrain.executors.model_parallel.validation import validate

    examples = Path(__file__).resolve().parents[3] / "examples"
    path = examples / "model_parallel_interleaved.toml"
    import_plugins(["residual_model.py"], base=examples)  # as the CLI does for run.imports
    plan = validate(load_job(path))
    assert [p.rank for p in plan.segments] == [0, 1, 0, 1]
    text = path.read_text()
    for old, new, match in (
            ('schedule = "Interleaved1F1B", virtual_stages = 2', 'schedule = "ZBH1"',
             r"separate runs.*Interleaved1F1B"),
            ("virtual_stages = 2", "virtual_stages = 3", r"virtual_stages = 3, but the partitions place 2")):
        job = tmp_path / "job.toml"
        job.write_text(text.replace(old, new))
        with pytest.raises(ConfigError, match=match):
            validate(load_job(job))
