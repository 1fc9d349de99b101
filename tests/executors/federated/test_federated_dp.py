"""[federated.dp] maths and configuration, without a run: the accountant against Opacus
called directly (and the exact Gaussian mechanism as a sanity bound), clipping properties,
seeded noise, adaptive clipping, the central estimator against FedAvg, and the job
section's validation (bad values name the field; JSON round trip)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

from _workers_federated import fed_job
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.executors.federated.aggregation import fedavg_step
from paratrain.executors.federated.checks import check_job
from paratrain.executors.federated.privacy import PrivacyAccountant, ServerPrivacy, dp_lines
from paratrain.executors.federated.privacy.mechanism import (
    adaptive_clip,
    add_noise,
    clip_update,
    dp_generator,
    update_noise_multiplier,
    update_norm,
)

DP = {"clip": 1.0, "noise_multiplier": 1.1}


# ------------------------------------------------------------------ the accountant


@pytest.mark.parametrize("z, q, rounds, delta", [
    (1.1, 0.01, 1000, 1e-5), (0.8, 0.1, 40, 1e-5), (2.0, 1.0, 25, 1e-6), (0.5, 0.02, 200, 1e-3)])
def test_epsilon_equals_opacus_called_directly(z: float, q: float, rounds: int, delta: float) -> None:
    from opacus.accountants import RDPAccountant

    ours, theirs = PrivacyAccountant(delta), RDPAccountant()
    for _ in range(rounds):
        ours.step(z, q)
        theirs.step(noise_multiplier=z, sample_rate=q)
    assert ours.epsilon() == theirs.get_epsilon(delta=delta)
    # a change of (z, q) mid-run composes as Opacus composes it; the state round-trips
    ours.step(2 * z, q)
    theirs.step(noise_multiplier=2 * z, sample_rate=q)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    again = PrivacyAccountant(delta)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert again.epsilon() == ours.epsilon() == theirs.get_epsilon(delta=delta)
    assert again.epsilon_after(z, q) > again.epsilon()  # one more round costs more
    assert PrivacyAccountant(delta).epsilon() == 0.0
    zero = PrivacyAccountant(delta)
    zero.step(0.0, q)
    assert zero.epsilon() == math.inf  # no noise, no guarantee


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Balle & Wang 2018 (analytic Gaussian mechanism): the exact epsilon of a Gaussian
    mechanism with sensitivity / sigma = mu, i.e. delta(eps) = Phi(mu/2 - eps/mu)
    - e^eps Phi(-mu/2 - eps/mu) solved for eps."""
    def gap(eps: float) -> float:
        return float(stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu)) - delta
    return float(optimize.brentq(gap, 0.0, 100.0))


@pytest.mark.parametrize("z, rounds", [(1.0, 1), (2.0, 16), (5.0, 100)])
def test_full_participation_epsilon_brackets_the_exact_gaussian_mechanism(z: float, rounds: int) -> None:
    """Sanity against a published closed form: with q = 1, T rounds at multiplier z are one
    Gaussian mechanism with mu = sqrt(T) / z, whose exact epsilon (Balle & Wang 2018) the
    RDP bound must not undercut, and stays close to (within 35 %)."""
    acc = PrivacyAccountant(1e-5)
    for _ in range(rounds):
        acc.step(z, 1.0)
    exact = _exact_gaussian_epsilon(math.sqrt(rounds) / z, 1e-5)
    assert exact <= acc.epsilon() <= 1.35 * exact


# ------------------------------------------------------------------ clipping and noise

_vectors = st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(a=_vectors, b=_vectors, clip=st.floats(1e-3, 1e3))
def test_clipped_update_is_within_the_clip_and_keeps_its_direction(a: list[float], b: list[float],
                                                                    clip: float) -> None:
    update = {"w": torch.tensor(a, dtype=torch.float32), "b": torch.tensor(b, dtype=torch.float32)}
    clipped, norm = clip_update(update, clip)
    assert norm == pytest.approx(update_norm(update))
    assert update_norm(clipped) <= clip * (1 + 1e-6)
    if norm <= clip:  # unchanged: the same tensors
        assert all(clipped[k] is update[k] for k in update)
    else:  # a positive multiple of the update: same direction, norm = clip
        factor = clip / norm
        for k in update:
            assert torch.allclose(clipped[k].double(), update[k].double() * factor, rtol=1e-6, atol=1e-30)
        assert update_norm(clipped) == pytest.approx(clip, rel=1e-5)
    same, _ = clip_update(update, None)
    assert all(same[k] is update[k] for k in update)  # clip = inf: untouched


def test_noise_is_a_function_of_seed_round_and_client() -> None:
    total = {"a": torch.zeros(4000, dtype=torch.float64), "b": torch.zeros(3, 3, dtype=torch.float64)}
    one = add_noise(total, 0.5, dp_generator(7, 3))
    assert all(torch.equal(one[k], add_noise(total, 0.5, dp_generator(7, 3))[k]) for k in total)
    assert not torch.equal(one["a"], add_noise(total, 0.5, dp_generator(7, 4))["a"])
    assert not torch.equal(one["a"], add_noise(total, 0.5, dp_generator(7, 3, client=1))["a"])
    assert float(one["a"].std()) == pytest.approx(0.5, rel=0.05)
    assert add_noise(total, 0.0, dp_generator(7, 3))["a"] is total["a"]


def test_adaptive_clip_follows_the_target_quantile() -> None:
    """Andrew et al.: without count noise the geometric update settles at the gamma-quantile
    of the update norms (here norms 1..100: the 0.3 quantile is ~30)."""
    norms = torch.arange(1, 101, dtype=torch.float64)
    clip = 1.0
    for r in range(400):
        unclipped = int((norms <= clip).sum())
        clip, frac = adaptive_clip(clip, unclipped, 100.0, target_quantile=0.3, learning_rate=0.2,
                                   count_stddev=1e-12, generator=dp_generator(0, r, salt="t"))
    assert 28.0 <= clip <= 33.0 and abs(frac - 0.3) <= 0.03
    # the combined multiplier of updates (z_D) and count (sigma_b) is the configured z
    z_d = update_noise_multiplier(1.0, 2.0)
    assert z_d > 1.0 and (z_d ** -2 + (2 * 2.0) ** -2) ** -0.5 == pytest.approx(1.0)
    assert update_noise_multiplier(1.0, None) == 1.0
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        update_noise_multiplier(1.0, 0.5)


def test_central_estimator_without_noise_or_clip_is_fedavg_bit_for_bit() -> None:
    """z = 0, clip = inf, weight_cap >= every n_k, all clients: the fixed-denominator
    estimator is FedAvg's example-weighted mean, bit for bit; with noise it is not."""
    g = torch.Generator().manual_seed(0)
    glob = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    sizes = [17, 3, 40, 9]
    ups = [{k: torch.randn(v.shape, generator=g) for k, v in glob.items()} for _ in sizes]
    job = fed_job("/tmp", "x", K=4, dp={"clip": math.inf, "noise_multiplier": 0.0, "weight_cap": 100})
    spec = job.federated.dp
    assert spec is not None and spec.clip is None
    priv = ServerPrivacy(spec, seed=0, sample_rate=1.0, num_clients=4, total_weight=float(sum(sizes)))
    [step], w, rec = priv.privatize(0, glob, ups, [float(n) for n in sizes])
    ref = fedavg_step(ups, [float(n) for n in sizes])
    assert w == [1.0] and all(torch.equal(step[k], ref[k]) for k in glob)
    noisy_spec = spec.model_copy(update={"clip": 1.0, "noise_multiplier": 0.5})
    noisy = ServerPrivacy(noisy_spec, seed=0, sample_rate=1.0, num_clients=4, total_weight=float(sum(sizes)))
    [step2], _, rec2 = noisy.privatize(0, glob, ups, [float(n) for n in sizes])
    assert not torch.equal(step2["w"], ref["w"])
    assert rec2["dp_noise_std"] == pytest.approx(0.5 * 1.0 * 100 / sum(sizes))


# ------------------------------------------------------------------ the job section


def _problems(doc_dp: dict[str, Any], **kw: Any) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        job = fed_job("/tmp", "x", dp=doc_dp, **kw)
        check_job(job, world_size=1)
    return dict(e.value.problems)


def test_bad_values_name_the_field(tmp_path: Path) -> None:
    assert "federated.dp.noise_multiplier" in _problems({"clip": 1.0, "noise_multiplier": -1})
    assert "federated.dp.mode" in _problems({**DP, "mode": "global"})
    assert "federated.dp.delta" in _problems({**DP, "delta": 0.0})
    assert "federated.dp.clip" in _problems({"clip": 0.0, "noise_multiplier": 1.0})
    assert "federated.dp.noise_multiplier" in _problems({"clip": 1.0})  # required
    assert "federated.dp.bogus" in _problems({**DP, "bogus": 1})
    assert "federated.dp" in _problems({"clip": math.inf, "noise_multiplier": 1.0})
    assert "federated.dp" in _problems({**DP, "mode": "local", "target_quantile": 0.5})
    # robust aggregators need single updates: central DP is refused, local is fine
    msg = _problems(DP, agg={"method": "Krum", "num_malicious": 1, "to_keep": 0})["federated.dp.mode"]
    assert "Krum" in msg and "local" in msg
    assert "federated.dp.mode" in _problems(DP, agg={"method": "FedMedian"})
    check_job(fed_job("/tmp", "x", agg={"method": "FedMedian"}, dp={**DP, "mode": "local"}), world_size=1)
    # client parts sent beside the update, outside the mechanism
    for method in ("SCAFFOLD", "FedNova"):
        for mode in ("central", "local"):
            msg = _problems({**DP, "mode": mode}, agg={"method": method})["strategy.aggregation.method"]
            assert method in msg and "does not clip or noise" in msg
    # settings the mode or the fixed clip would not read
    assert "weight_cap" in _problems({**DP, "mode": "local", "weight_cap": 10})["federated.dp"]
    assert "target_quantile" in _problems({**DP, "clip_learning_rate": 0.1})["federated.dp"]
    # the count's noise alone would exceed the budget
    assert "federated.dp.clipped_count_stddev" in _problems(
        {**DP, "target_quantile": 0.5, "clipped_count_stddev": 0.2})


def test_json_round_trip_and_validate_lines() -> None:
    job = fed_job("/tmp", "x", K=10, rounds=50, sel={"method": "Random", "fraction": 0.3},
                  dp={**DP, "target_epsilon": 8.0, "target_quantile": 0.5, "delta": 1e-6,
                      "clipped_count_stddev": 2.0})
    again = load_job(job.to_json_dict())
    assert again == job and again.federated.dp is not None and again.federated.dp.delta == 1e-6
    inf = fed_job("/tmp", "x", dp={"clip": math.inf, "noise_multiplier": 0.0})
    assert inf.federated.dp is not None and inf.federated.dp.clip is None
    assert load_job(inf.to_json_dict()) == inf
    lines = dp_lines(job)
    assert "central DP-FedAvg" in lines[0] and "adaptive to the 0.5 quantile" in lines[0]
    assert "sample rate 0.3" in lines[1] and "after all 50 rounds" in lines[1]
    assert "target_epsilon 8 stops the run after round" in lines[2]
