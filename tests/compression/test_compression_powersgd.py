"""PowerSGD: the maths (pure tensors), the config errors, and 2 real gloo ranks against
torch's ``powerSGD_hook`` (parameters), exact resume and bytes per step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

from _workers_powersgd import START, STEPS, dp_job_runs, scenarios
from paratrain.comm.ddp_hook import allreduce_powersgd
from paratrain.comm.testing import run_distributed
from paratrain.compression import CompressionError, Compressor
from paratrain.compression.powersgd import (
    PowerSGDState,
    orthogonalize,
    should_compress,
    wire_numel,
)
from paratrain.config import ConfigError
from paratrain.config.compression import dump_compression, load_compression

# -------------------------------------------------------------------------- the maths


@pytest.mark.parametrize("k", [1, 2, 4])
def test_orthogonalize_equals_torch_and_is_orthonormal(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    a = torch.randn(3, 20, k, generator=g)
    ours, theirs = a.clone(), a.clone()
    orthogonalize(ours)
    tp._orthogonalize(theirs)
    assert torch.equal(ours, theirs)  # Gram-Schmidt for k <= 2, QR above: torch's choice
    eye = torch.eye(k).expand(3, k, k)
    torch.testing.assert_close(ours.transpose(1, 2) @ ours, eye, rtol=0, atol=1e-5)


def test_zero_column_stays_zero_and_epsilon_as_torch() -> None:
    a = torch.zeros(1, 5, 1)
    orthogonalize(a)  # torch's tensor division gives NaN here; its intent (and ours) is 0
    assert torch.equal(a, torch.zeros(1, 5, 1))
    b = torch.randn(2, 6, 2, generator=torch.Generator().manual_seed(1))
    ours, theirs = b.clone(), b.clone()
    orthogonalize(ours, 1e-8)
    tp._orthogonalize(theirs, 1e-8)
    assert torch.equal(ours, theirs)


def test_should_compress_is_torchs_rule_and_wire_formula() -> None:
    for n, m, r, rate in [(4, 32, 1, 2), (4, 32, 2, 2), (32, 32, 4, 2), (3, 3, 8, 1), (10, 1, 1, 0)]:
        assert should_compress(n, m, r, rate) == tp._should_compress(n, m, min(n, m, r), rate)[0]
    # (32,16) and (4,32) at rank 1: r(n+m) each; the bias (1-D) and (4,32) at rank 2 go whole.
    assert wire_numel([(32, 16), (32,), (4, 32)], 1) == 48 + 32 + 36
    assert wire_numel([(32, 16), (32,), (4, 32)], 2) == 96 + 32 + 128
    assert wire_numel([(8, 2, 3, 3)], 1) == 8 + 18  # a conv kernel is (out, in*kh*kw)


def _single(state: PowerSGDState, named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    return allreduce_powersgd(state, named)  # one process: the maths without a group


def test_exact_on_a_low_rank_matrix_and_residual_zero() -> None:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(30, 2, generator=g) @ torch.randn(2, 40, generator=g)  # rank 2
    state = PowerSGDState(2)
    (out,) = _single(state, [("w", m)])
    torch.testing.assert_close(out, m, rtol=1e-4, atol=1e-4)
    assert float(state.residuals["w"].abs().max()) < 1e-4


def test_error_feedback_telescopes_and_start_step_is_plain() -> None:
    """sum_t out_t + e_T = sum_t g_t (nothing lost, only delayed); before start_step the
    output is the input itself and no state is kept."""
    g = torch.Generator().manual_seed(1)
    state = PowerSGDState(1, start_step=2)
    grads = [torch.randn(12, 10, generator=g, dtype=torch.float64) for _ in range(6)]
    bias = torch.randn(12, generator=g, dtype=torch.float64)
    total = torch.zeros(12, 10, dtype=torch.float64)
    for t, gr in enumerate(grads):
        out, b = _single(state, [("w", gr), ("b", bias)])
        if t < 2:
            assert torch.equal(out, gr) and not state.residuals
        assert torch.equal(b, bias)  # 1-D: never compressed
        total += out
        state.advance()
    torch.testing.assert_close(total + state.residuals["w"].reshape(12, 10), sum(grads))
    assert "b" not in state.residuals


def test_state_dict_resumes_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(2)
    grads = [[("a", torch.randn(16, 8, generator=g)), ("c", torch.randn(8, 3, 3, generator=g))]
             for _ in range(6)]

    def run(state: PowerSGDState, gs: list[Any]) -> list[torch.Tensor]:
        outs = []
        for named in gs:
            outs += _single(state, named)
            state.advance()
        return outs

    whole = run(PowerSGDState(2, start_step=1, warm_start=False, seed=3), grads)
    first = PowerSGDState(2, start_step=1, warm_start=False, seed=3)
    part = run(first, grads[:3])
    second = PowerSGDState(2, start_step=1, warm_start=False, seed=0)
    second.load_state_dict(first.state_dict())
    part += run(second, grads[3:])
    assert all(torch.equal(x, y) for x, y in zip(whole, part, strict=True))


# ------------------------------------------------------------------------- the config


@pytest.mark.parametrize(("doc", "field"), [
    ({"method": "PowerSGD", "rank": 0}, "rank"),
    ({"method": "PowerSGD"}, "rank"),
    ({"method": "PowerSGD", "rank": 2.5}, "rank"),
    ({"method": "PowerSGD", "rank": 1, "start_step": -1}, "start_step"),
    ({"method": "PowerSGD", "rank": 1, "min_compression_rate": -1.0}, "min_compression_rate"),
    ({"method": "PowerSGD", "rank": 1, "orthogonalization_epsilon": float("nan")},
     "orthogonalization_epsilon"),
    ({"method": "ErrorFeedback", "error_compensation": True,
      "base_strategy": {"method": "PowerSGD", "rank": 1}}, "base_strategy"),
])
def test_config_errors_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_compression(doc)
    assert field in str(e.value)


def test_config_round_trip_and_not_a_per_tensor_codec() -> None:
    doc = {"method": "PowerSGD", "rank": 4, "start_step": 10}
    assert dump_compression(load_compression(doc)) == doc
    comp = Compressor(doc, seed=0)
    with pytest.raises(CompressionError, match="all-reduce"):
        comp.compress("w", torch.randn(4, 4))


# -------------------------------------------------------------- 2 gloo ranks vs torch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = str(tmp_path_factory.mktemp("psgd"))
    out: list[dict[str, Any]] = run_distributed(scenarios, 2, folder, timeout_s=180)
    for r in out:
        r["folder"] = folder
    return out


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_grad_sync_equals_torch_powersgd_hook_bitwise(ranks: list[dict[str, Any]], rank: int) -> None:
    """No 1-D tensors and every matrix compressed: DataParallel's exchange (one bucket in
    DDP's gradient-ready order) gives torch's parameters bit for bit, QR path (rank 4) too."""
    for r in ranks:
        assert _equal(r[f"ours_r{rank}"], r[f"torch_r{rank}"])
    assert _equal(ranks[0][f"ours_r{rank}"], ranks[1][f"ours_r{rank}"])


@pytest.mark.slow
def test_ddp_hook_equals_torch_and_seed_matters(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    assert _equal(r["hook_r2"], r["torch_r2"])
    # Non-vacuity: another seed for the first random Q gives other parameters.
    assert max(float(np.abs(x - y).max()) for x, y in zip(r["torch_r2_seed1"], r["torch_r2"], strict=True)) > 1e-4


@pytest.mark.slow
def test_with_biases_equal_torch_up_to_rounding(ranks: list[dict[str, Any]]) -> None:
    """torch's bucket-wide error memory also holds x_w - mean(x) for the uncompressed
    biases; it sums to zero over ranks, so only float rounding differs (we keep none)."""
    r = ranks[0]
    for key in ("ours_bias_r2", "hook_bias_r2"):
        for x, y in zip(r[key], r["torch_bias_r2"], strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_exact_resume_from_a_checkpoint_file(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert _equal(r["resumed_bias_r2"], r["ours_bias_r2"])


@pytest.mark.slow
def test_data_parallel_job_resumes_bit_identical(ranks: list[dict[str, Any]],
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """The DataParallel runner with [compression] PowerSGD: a run checkpointed at step 3 and
    resumed in fresh processes ends where the uninterrupted run ends (residuals and warm Q
    per rank in the checkpoint; without restoring them the parameters differ by ~1e-2)."""
    resumed = run_distributed(dp_job_runs, 2, ranks[0]["folder"], "second", timeout_s=180)
    for r, res in zip(ranks, resumed, strict=True):
        assert res["steps"] == 6
        assert _equal(res["resumed"], r["dp_full"])


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_bytes_per_step_equal_the_formula(ranks: list[dict[str, Any]], rank: int) -> None:
    shapes = [(32, 16), (32, 32), (16, 32)]
    dense = 4 * sum(n * m for n, m in shapes)
    powersgd = 4 * wire_numel(shapes, rank)
    assert powersgd == 4 * rank * (48 + 64 + 48)
    assert ranks[0][f"bytes_r{rank}"] == [dense] * START + [powersgd] * (STEPS - START)
    assert ranks[0][f"calls_r{rank}"] == START + 2 * (STEPS - START)  # P then Q


@pytest.mark.parametrize("strategy", [
    {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "ParameterServer"}},
    {"type": "DataParallel", "num_replicas": 2,
     "aggregation": {"method": "Decentralized", "topology": "ring"}},
    {"type": "Federated", "num_clients": 2, "rounds": 1, "aggregation": {"method": "FedAvg"},
     "client_selection": {"method": "All"}},
])
def test_job_refuses_powersgd_outside_an_all_reduce(strategy: dict[str, Any]) -> None:
    from paratrain.config.job import load_job

    doc = {"run": {"name": "x"}, "model": {"name": "mlp"}, "data": {"name": "digits"},
           "compression": {"method": "PowerSGD", "rank": 1}}
    with pytest.raises(ConfigError, match="compression.method: PowerSGD runs inside an all-reduce"):
        load_job({**doc, "strategy": strategy})
    load_job({**doc, "strategy": {"type": "DataParallel", "num_replicas": 2,
                                  "aggregation": {"method": "AllReduce"}}})
