"""Regression tests for issue 12, defects 6 (Krum ties), 5 (PBT small integers) and
2 (compressed DDP hook repeats a random draw after resume)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from paratrain.config.job import IntDim, UniformDim
from paratrain.config.strategy import Perturbation
from paratrain.executors.federated.aggregation import krum_select
from paratrain.executors.federated.aggregation.robust import (
    krum_scores,
    pairwise_squared_distances,
)
from paratrain.executors.population_based.pbt import explore, perturb_dim
from paratrain.files import step_folders

# ------------------------------------------------------------------ defect 6: Krum ties

# Integer updates, n = 5, f = 0 -> m = 3 nearest. Exact scores: [70, 60, 96, 70, 60]:
# clients 1 and 4 tie at 60, so Krum must pick 1 (lowest index). With distances taken
# through a square root and squared back, client 4's score rounds below client 1's.
TIE = torch.tensor(
    [[3.0, 2.0, -3.0], [1.0, 2.0, 2.0], [3.0, -3.0, 2.0], [1.0, 2.0, -3.0], [3.0, 1.0, 3.0]],
    dtype=torch.float64,
)


def _sqrt_then_square_select(x: torch.Tensor, f: int) -> int:
    """The old scoring: cdist (a square root) then ``** 2``."""
    n = x.shape[0]
    d2 = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    d2 = d2.masked_fill(torch.eye(n, dtype=torch.bool), float("inf"))
    m = min(max(1, n - f - 2), n - 1)
    s = torch.sort(d2, dim=1).values[:, :m].sum(1)
    return int(torch.sort(s, stable=True).indices[0])


def test_the_tie_case_really_breaks_sqrt_then_square() -> None:
    # the premise of the next test: the old computation picks client 4
    assert _sqrt_then_square_select(TIE, 0) == 4


def test_krum_exact_tie_goes_to_lowest_index() -> None:
    assert krum_scores(TIE, 0).tolist() == [70.0, 60.0, 96.0, 70.0, 60.0]
    assert krum_select(TIE, num_malicious=0, to_keep=0) == [1]
    assert krum_select(TIE, num_malicious=0, to_keep=2) == [1, 4]
    # float32 input gives the same exact answer
    assert krum_select(TIE.float(), num_malicious=0, to_keep=0) == [1]


def test_pairwise_squared_distances_exact_and_symmetric() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-50, 50, (9, 17), generator=g).to(torch.float64)
    d2 = pairwise_squared_distances(x)
    ref = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    assert torch.equal(d2, ref)
    assert torch.equal(d2, d2.T)
    assert torch.equal(d2.diagonal(), torch.zeros(9, dtype=torch.float64))


# ------------------------------------------------------------------ defect 5: PBT ints


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_small_ints_move_by_at_least_one_when_perturbed() -> None:
    dim = IntDim(low=1, high=4)
    g = _gen(0)
    for v in (1, 2, 3, 4):
        got = {perturb_dim(dim, v, 0.2, g) for _ in range(60)}
        expected = {max(v - 1, 1), min(v + 1, 4)}
        assert got == expected, (v, got)


def test_every_value_of_a_small_int_range_is_reachable_from_low() -> None:
    dim = IntDim(low=1, high=4)
    g = _gen(1)
    v, seen = 1, {1}
    for _ in range(200):
        v = perturb_dim(dim, v, 0.2, g)
        assert 1 <= v <= 4 and type(v) is int
        seen.add(v)
    assert seen == {1, 2, 3, 4}


def test_int_reachability_through_explore() -> None:
    space = {"layers": IntDim(low=1, high=4)}
    g = _gen(2)
    h: dict[str, object] = {"layers": 1}
    seen = {1}
    for _ in range(200):
        h = explore(h, space, Perturbation(factor=0.2), g)
        seen.add(int(h["layers"]))  # type: ignore[call-overload]
    assert seen == {1, 2, 3, 4}


def test_factor_zero_and_floats_unchanged() -> None:
    g = _gen(3)
    assert all(perturb_dim(IntDim(low=1, high=4), 2, 0.0, g) == 2 for _ in range(20))
    # floats: the same single draw and formula as before (value * (1 + (2u - 1) f))
    dim = UniformDim(low=0.0, high=100.0)
    g1, g2 = _gen(4), _gen(4)
    for _ in range(50):
        u = float(torch.rand((), generator=g2, dtype=torch.float64))
        assert perturb_dim(dim, 10.0, 0.2, g1) == min(max(10.0 * (1 + (2 * u - 1) * 0.2), 0.0), 100.0)
    # and an int perturbation consumes exactly one draw, like a float one
    g1, g2 = _gen(5), _gen(5)
    perturb_dim(IntDim(low=1, high=4), 1, 0.2, g1)
    perturb_dim(dim, 1.0, 0.2, g2)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_large_ints_still_scale_multiplicatively() -> None:
    dim = IntDim(low=1, high=1000)
    g = _gen(6)
    vals = [perturb_dim(dim, 100, 0.2, g) for _ in range(300)]
    assert min(vals) >= 80 and max(vals) <= 120
    assert min(vals) <= 82 and max(vals) >= 118


# ------------------------------------------------------------------ defect 2: hook resume

HOOK_STRATEGIES: dict[str, dict[str, Any]] = {
    "RandomK": {"method": "RandomK", "k": 5},
    "Quantization": {"method": "Quantization", "bits": 4},  # stochastic rounding
    "EF(TopK)": {"method": "ErrorFeedback", "error_compensation": True,
                 "base_strategy": {"method": "TopK", "k": 5}},
}
TOTAL, FIRST = 6, 3


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)


def _hooked(strategy: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.comm.ddp_hook import ddp_hook

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4)))
    state, hook = ddp_hook(strategy, model=model, seed=7)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, state, opt


def _steps(ctx: Any, model: Any, opt: Any, start: int, stop: int) -> None:
    for s in range(start, stop):
        x, y = _batch(s, ctx.rank)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat_params(model: Any) -> list[Any]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def hook_resume_first(ctx: Any, tmp: str) -> dict[str, Any]:
    """Per strategy: TOTAL uninterrupted steps; and FIRST steps saved to disk."""
    out: dict[str, Any] = {}
    for name, strategy in HOOK_STRATEGIES.items():
        model, state, opt = _hooked(strategy)
        _steps(ctx, model, opt, 0, TOTAL)
        out[name] = _flat_params(model)
        model, state, opt = _hooked(strategy)
        _steps(ctx, model, opt, 0, FIRST)
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()}, f"{tmp}/{name}-{ctx.rank}.pt")
    return out


def hook_resume_second(ctx: Any, tmp: str) -> dict[str, Any]:
    """Fresh processes: load the saved state and run the remaining steps."""
    out: dict[str, Any] = {}
    for name, strategy in HOOK_STRATEGIES.items():
        model, state, opt = _hooked(strategy)
        saved = torch.load(f"{tmp}/{name}-{ctx.rank}.pt", weights_only=True)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
        _steps(ctx, model, opt, FIRST, TOTAL)
        out[name] = _flat_params(model)
    return out


@pytest.mark.slow
def test_ddp_hook_resume_repeats_the_original_draws(resume_phases: dict[str, Any]) -> None:
    full, resumed = resume_phases["full"]["hook"], resume_phases["resumed"]["hook"]
    differ = sorted({
        name for name in HOOK_STRATEGIES for rank in range(2)
        for a, b in zip(full[rank][name], resumed[rank][name], strict=True)
        if not np.array_equal(a, b)
    })
    assert differ == [], f"resumed runs differ from the uninterrupted ones: {differ}"
    for name in HOOK_STRATEGIES:
        # ranks agree (the hook really synchronised)
        for a, b in zip(full[0][name], full[1][name], strict=True):
            assert np.array_equal(a, b)


# ---------------------------------------------- defect 2 through DataParallel's checkpoint

DP_COMPRESSION = {"RandomK": {"method": "RandomK", "k": 5}}


def _dp(tmp: str, name: str, world: int, compression: dict[str, Any], steps: int) -> Any:
    from _workers_dp import dp_job

    job = dp_job(tmp, name, world, {"method": "AllReduce"}, compression=compression)
    doc = job.to_json_dict()
    doc["run"]["checkpoint_every"] = 3
    doc["train"]["max_steps"] = steps
    from paratrain.config import load_job

    return load_job(doc)


def dp_resume(ctx: Any, tmp: str, phase: str) -> dict[str, Any]:
    from paratrain.executors.data_parallel.runner import train_replica

    out: dict[str, Any] = {}
    for name, comp in DP_COMPRESSION.items():
        if phase == "first":
            model, _ = train_replica(ctx, _dp(tmp, f"full-{name}", 2, comp, 6), False, plot=False)
            out[name] = _flat_params(model)
            train_replica(ctx, _dp(tmp, f"part-{name}", 2, comp, 3), False, plot=False)
        else:
            model, s = train_replica(ctx, _dp(tmp, f"part-{name}", 2, comp, 6), True, plot=False)
            assert s["steps"] == 6
            out[name] = _flat_params(model)
    return out


def both_phases(ctx: Any, tmp: str, phase: str) -> dict[str, Any]:
    """The hook and the DataParallel resume workers of one phase in one launch (each
    launch starts fresh processes: two launches instead of four). Phase "second" runs in
    processes that never trained the first phase, as before."""
    hook = hook_resume_first(ctx, tmp) if phase == "first" else hook_resume_second(ctx, tmp)
    return {"hook": hook, "dp": dp_resume(ctx, tmp, phase)}


@pytest.fixture(scope="module")
def resume_phases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from paratrain.comm.testing import run_distributed

    tmp = tmp_path_factory.mktemp("resume")
    full = run_distributed(both_phases, 2, str(tmp), "first", timeout_s=300)
    # read between the phases: the second phase rewrites the part run's marker
    markers = {name: json.loads((step_folders(tmp / f"part-{name}" / "checkpoints")[-1] / "layout.json").read_text())
               for name in DP_COMPRESSION}
    resumed = run_distributed(both_phases, 2, str(tmp), "second", timeout_s=300)
    return {"full": {k: [r[k] for r in full] for k in ("hook", "dp")}, "markers": markers,
            "resumed": {k: [r[k] for r in resumed] for k in ("hook", "dp")}}


@pytest.mark.slow
def test_data_parallel_compressed_resume_is_bit_identical(resume_phases: dict[str, Any]) -> None:
    full, resumed = resume_phases["full"]["dp"], resume_phases["resumed"]["dp"]
    # the second phase really resumes: step 3 is a complete checkpoint of the part run
    for name in DP_COMPRESSION:
        assert resume_phases["markers"][name]["step"] == 3
    differ = sorted({
        name for name in DP_COMPRESSION for rank in range(2)
        for a, b in zip(full[rank][name], resumed[rank][name], strict=True)
        if not np.array_equal(a, b)
    })
    assert differ == [], f"resumed DataParallel runs differ: {differ}"
