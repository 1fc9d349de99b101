"""Properties of the five leaf methods and the two wrappers (pure maths, one process)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from paratrain.compression import (
    CompressionError,
    Compressor,
    decompress,
    pack_codes,
    packed_nbytes,
    randomk_positions,
    topk_indices,
    unpack_codes,
)
from paratrain.compression.base import EncodeContext
from paratrain.compression.codecs import QuantizationCodec

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
vectors = arrays(np.float32, st.integers(0, 300), elements=finite)


def stable_topk_reference(x: np.ndarray, k: int) -> np.ndarray:
    """The Rust reference: stable sort by |v| descending, first min(k, n), ascending."""
    order = np.argsort(-np.abs(x.astype(np.float64)), kind="stable")
    return np.sort(order[: min(k, x.size)])


# --------------------------------------------------------------------------- TopK
@given(vectors, st.integers(1, 400))  # k = 0 is a ConfigError (it would send nothing)
def test_topk_exact_count_and_error_bound(x: np.ndarray, k: int) -> None:
    t = torch.from_numpy(x)
    comp = Compressor({"method": "TopK", "k": k})
    c = comp.compress("w", t)
    n = t.numel()
    assert c.nnz == min(k, n)
    assert np.array_equal(c.indices.numpy(), stable_topk_reference(x, k))
    d = decompress(c).double()
    xd = t.double()
    err = float(((xd - d) ** 2).sum())
    bound = (1 - min(k, n) / n) * float((xd**2).sum()) if n else 0.0
    assert err <= bound * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("n,k", [(1 << 16, 655), (200_000, 2000), (1 << 20, 10_486), (300_000, 20)])
def test_topk_fast_path_matches_reference(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    for x in (
        torch.randn(n, generator=g),
        torch.randint(-40, 41, (n,), generator=g).float(),  # heavy ties
        torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.01),  # mostly zeros
    ):
        got = topk_indices(x, k).numpy()
        assert np.array_equal(got, stable_topk_reference(x.numpy(), k))


def test_topk_nan_counts_as_largest_and_fast_path_consistent() -> None:
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(0))
    x[[5, 777, 90000]] = math.nan
    for k in (2, 3, 2000):  # exact path (k small) and fast path
        idx = topk_indices(x, k).tolist()
        assert len(idx) == k
        assert set(idx) & {5, 777, 90000} == ({5, 777} if k == 2 else {5, 777, 90000})


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_dtypes_and_edges(dtype: torch.dtype) -> None:
    x = torch.tensor([0.1, 3.0, 0.2, -4.0, 0.05], dtype=dtype)
    d = Compressor({"method": "TopK", "k": 2}).roundtrip("a", x)
    assert d.dtype == dtype
    assert d.tolist() == torch.tensor([0, 3.0, 0, -4.0, 0], dtype=dtype).tolist()
    with pytest.raises(ValueError, match="k = 0 keeps no entry"):  # ConfigError: sends nothing
        Compressor({"method": "TopK", "k": 0})
    assert torch.equal(Compressor({"method": "TopK", "k": 99}).roundtrip("a", x), x)
    empty = torch.empty(0, 3, dtype=dtype)
    assert Compressor({"method": "TopK", "k": 4}).roundtrip("a", empty).shape == (0, 3)
    scalar = torch.tensor(2.5, dtype=dtype)
    assert Compressor({"method": "TopK", "k": 1}).roundtrip("a", scalar).item() == 2.5


# --------------------------------------------------------------------------- RandomK
@given(st.integers(0, 5000), st.integers(0, 6000), st.integers(0, 2**31), st.integers(0, 50))
@settings(max_examples=200)
def test_randomk_positions_deterministic_and_distinct(n: int, k: int, seed: int, step: int) -> None:
    ctx = EncodeContext("layer.weight", step, seed)
    s = ctx.derived_seed("RandomK")
    a = randomk_positions(n, k, s)
    assert torch.equal(a, randomk_positions(n, k, s))
    assert a.numel() == min(k, n)
    assert a.numel() == 0 or (bool(torch.all(a[1:] > a[:-1])) and 0 <= int(a[0]) and int(a[-1]) < n)
    if 0 < k < n and math.comb(n, min(k, n)) > 10**6:
        other = EncodeContext("layer.weight", step + 1, seed).derived_seed("RandomK")
        assert not torch.equal(a, randomk_positions(n, k, other))


def test_randomk_same_on_ranks_and_uniform() -> None:
    x = torch.randn(20)
    r0, r1 = (Compressor({"method": "RandomK", "k": 5}, seed=7) for _ in range(2))
    for step in range(20):  # two "ranks" with the same seed agree at every step
        c0, c1 = r0.compress("w", x, step=step), r1.compress("w", x, step=step)
        assert torch.equal(c0.indices, c1.indices)
        assert torch.equal(c0.values, x[c0.indices])
    counts = torch.zeros(20)
    for step in range(2000):
        counts[randomk_positions(20, 5, EncodeContext("w", step, 7).derived_seed("RandomK"))] += 1
    # Each position is kept with probability 1/4: 500 +- sqrt(2000 * 1/4 * 3/4) ~ 19.4
    assert float((counts - 500).abs().max()) < 5 * 19.4
    keys = {tuple(Compressor({"method": "RandomK", "k": 5}).compress(k, x).indices.tolist())
            for k in ("a", "b", "c", "d")}
    assert len(keys) > 1  # the key takes part in the seed


def test_randomk_large_sparse_draw_is_distinct() -> None:
    idx = randomk_positions(1_000_003, 12_345, 99)
    assert idx.numel() == 12_345 and torch.unique(idx).numel() == 12_345


# --------------------------------------------------------------------------- Threshold
@given(vectors, st.floats(0, 1e4, allow_nan=False), st.sampled_from(DTYPES))
def test_threshold_keeps_exactly_above(x: np.ndarray, t: float, dtype: torch.dtype) -> None:
    xt = torch.from_numpy(x).to(dtype)
    c = Compressor({"method": "Threshold", "threshold": t}).compress("w", xt)
    expected = np.flatnonzero(np.abs(xt.double().numpy()) > t)
    assert np.array_equal(c.indices.numpy(), expected)
    assert torch.equal(c.values, xt[c.indices])


def test_threshold_strict_boundary() -> None:
    x = torch.tensor([0.5, -0.5, 0.50001, -0.7, 0.1])
    d = Compressor({"method": "Threshold", "threshold": 0.5}).roundtrip("a", x)
    assert d.tolist() == pytest.approx([0, 0, 0.50001, -0.7, 0])


# --------------------------------------------------------------------------- Quantization
@given(st.integers(1, 32), st.lists(st.integers(0, 2**32 - 1), max_size=70))
def test_pack_unpack_exact_sizes(bits: int, raw: list[int]) -> None:
    codes = torch.tensor([v & ((1 << bits) - 1) for v in raw], dtype=torch.int64)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(len(raw), bits)
    assert packed.numel() == math.ceil(len(raw) * bits / 8)
    assert unpack_codes(packed, len(raw), bits).to(torch.int64).tolist() == codes.tolist()


def test_pack_layout_lsb_first() -> None:
    assert pack_codes(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]
    assert pack_codes(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1).tolist() == [0b1101, 1]


@given(vectors.filter(lambda a: a.size > 0), st.integers(1, 32), st.booleans(),
       st.sampled_from(DTYPES))
@settings(max_examples=150)
def test_quantization_error_bound(x: np.ndarray, bits: int, stochastic: bool, dtype: torch.dtype) -> None:
    xt = torch.from_numpy(x).to(dtype)
    comp = Compressor({"method": "Quantization", "bits": bits}, stochastic_rounding=stochastic)
    c = comp.compress("w", xt)
    assert c.values.numel() == packed_nbytes(xt.numel(), bits)
    d = decompress(c).double()
    xd = xt.double()
    scale = (float(xd.max()) - float(xd.min())) / ((1 << bits) - 1)
    bound = scale if stochastic else scale / 2
    # float32 arithmetic for <= 16 bits, plus the output dtype's rounding
    eps = torch.finfo(dtype).eps * float(xd.abs().max()) + 1e-6 * float(xd.abs().max()) + 1e-30
    assert float((d - xd).abs().max()) <= bound + eps


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_quantization_unbiased(bits: int) -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(bits)).double()
    # 64 elements at 4 SE each: a false alarm has probability ~0.4% per seed; a longer
    # run (12,000 draws, every width) showed max |z| ~2.3, i.e. no detectable bias.
    comp = Compressor({"method": "Quantization", "bits": bits}, seed=0)
    draws = torch.stack([comp.roundtrip("w", x, step=s) for s in range(1500)])
    mean, sd = draws.mean(0), draws.std(0)
    se = sd / math.sqrt(draws.shape[0])
    dev = (mean - x).abs()
    assert bool(torch.all(dev <= 4 * se + 1e-12)), float((dev / (se + 1e-30)).max())
    assert float(sd.max()) > 0  # non-vacuity: the rounding is random
    det = Compressor({"method": "Quantization", "bits": bits}, stochastic_rounding=False)
    assert torch.equal(det.roundtrip("w", x, step=0), det.roundtrip("w", x, step=1))


def test_quantization_rounding_field_selects_deterministic_rounding() -> None:
    """The job-file field ``rounding = "deterministic"`` (also inside wrappers) is the same
    codec as the ``stochastic_rounding=False`` keyword; the default stays stochastic."""
    x = torch.linspace(-1.0, 1.0, 257)
    field = {"method": "Quantization", "bits": 3, "rounding": "deterministic"}
    kw = Compressor({"method": "Quantization", "bits": 3}, stochastic_rounding=False)
    wrapped = Compressor({"method": "ErrorFeedback", "error_compensation": False, "base_strategy": field})
    for step in range(3):
        want = kw.roundtrip("w", x, step=step)
        assert torch.equal(Compressor(field).roundtrip("w", x, step=step), want)
        assert torch.equal(wrapped.roundtrip("w", x, step=step), want)
    assert (want - x).abs().max() <= (2.0 / 7) / 2 + 1e-6  # half a step of 2/(2^3 - 1)
    stochastic = Compressor({"method": "Quantization", "bits": 3, "rounding": "stochastic"})
    assert not torch.equal(stochastic.roundtrip("w", x, step=0), want)  # non-vacuity


def test_quantization_constant_nonfinite_and_invalid() -> None:
    c = torch.full((7,), 3.25)
    assert torch.equal(Compressor({"method": "Quantization", "bits": 2}).roundtrip("a", c), c)
    with pytest.raises(CompressionError, match="non-finite"):
        Compressor({"method": "Quantization", "bits": 8}).compress("a", torch.tensor([1.0, math.inf]))
    with pytest.raises(ValueError):
        QuantizationCodec(0)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    det = Compressor({"method": "Quantization", "bits": 8}, stochastic_rounding=False)
    assert det.roundtrip("a", x).tolist() == [1.0, 2.0, 3.0, 4.0]


# --------------------------------------------------------------------------- wrappers
@given(arrays(np.float32, st.integers(1, 60), elements=finite), st.floats(0.01, 100))
def test_clipping_bounds(x: np.ndarray, clip: float) -> None:
    xt = torch.from_numpy(x)
    for base in ({"method": "None"}, {"method": "TopK", "k": 5},
                 {"method": "Quantization", "bits": 4}):
        s = {"method": "ClippedCompression", "clip_value": clip, "base_strategy": base}
        d = Compressor(s).roundtrip("w", xt)
        assert float(d.abs().max()) <= clip * (1 + 1e-6)
    d = Compressor({"method": "ClippedCompression", "clip_value": clip,
                    "base_strategy": {"method": "None"}}).roundtrip("w", xt)
    assert torch.equal(d, xt.clamp(-clip, clip))


NESTED = [
    {"method": "TopK", "k": 3},
    {"method": "RandomK", "k": 4},
    {"method": "Threshold", "threshold": 0.8},
    {"method": "Quantization", "bits": 2},
    {"method": "ClippedCompression", "clip_value": 0.7, "base_strategy": {"method": "TopK", "k": 2}},
    {"method": "ErrorFeedback", "error_compensation": True,
     "base_strategy": {"method": "ClippedCompression", "clip_value": 1.0,
                       "base_strategy": {"method": "RandomK", "k": 3}}},
]


@pytest.mark.parametrize("base", NESTED, ids=lambda s: str(s["method"]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_error_feedback_telescopes(base: dict, dtype: torch.dtype) -> None:
    comp = Compressor({"method": "ErrorFeedback", "error_compensation": True, "base_strategy": base})
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(4, 5, dtype=torch.float64)
    total = torch.zeros(4, 5, dtype=torch.float64)
    for t in range(30):
        gt = torch.randn(4, 5, generator=g).to(dtype)
        sent += comp.roundtrip("w", gt, step=t).double()
        total += gt.double()
    e = comp.residual("w")
    assert e is not None
    torch.testing.assert_close(sent + e.double().reshape(4, 5), total, atol=1e-5, rtol=0)


def test_error_feedback_without_compensation_tracks_only() -> None:
    s = {"method": "ErrorFeedback", "error_compensation": False, "base_strategy": {"method": "TopK", "k": 1}}
    comp = Compressor(s)
    x = torch.tensor([1.0, -3.0, 2.0])
    assert comp.roundtrip("w", x).tolist() == [0, -3.0, 0]
    assert comp.residual("w").tolist() == [1.0, 0.0, 2.0]
    assert comp.roundtrip("w", x).tolist() == [0, -3.0, 0]  # residual not added back
    on = Compressor({**s, "error_compensation": True})
    on.roundtrip("w", x)
    assert on.roundtrip("w", x).tolist() == [0, 0, 4.0]  # p = x + [1, 0, 2]
    assert on.residual("w").tolist() == [2.0, -3.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_error_feedback_low_precision_residual_is_float32(dtype: torch.dtype) -> None:
    s = {"method": "ErrorFeedback", "error_compensation": True,
         "base_strategy": {"method": "Quantization", "bits": 2}}
    comp = Compressor(s)
    out = comp.roundtrip("w", torch.randn(10).to(dtype))
    assert out.dtype == dtype and comp.residual("w").dtype == torch.float32


def test_error_feedback_key_shape_mismatch_is_an_error() -> None:
    comp = Compressor({"method": "ErrorFeedback", "error_compensation": True,
                       "base_strategy": {"method": "TopK", "k": 1}})
    comp.compress("w", torch.ones(3))
    with pytest.raises(CompressionError, match="same tensor"):
        comp.compress("w", torch.ones(4))


def test_unsupported_input() -> None:
    with pytest.raises(CompressionError, match="dtype"):
        Compressor().compress("w", torch.ones(3, dtype=torch.int32))
    with pytest.raises(CompressionError, match="Tensor"):
        Compressor().compress("w", [1.0, 2.0])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- CPU kernels
@pytest.fixture
def plain_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.compression import _kernels

    monkeypatch.setattr(_kernels, "USE_BLOCKED", False)


def _both_paths(fn, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from paratrain.compression import _kernels

    fast = fn()
    monkeypatch.setattr(_kernels, "USE_BLOCKED", False)
    plain = fn()
    monkeypatch.setattr(_kernels, "USE_BLOCKED", True)
    return fast, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_blocked_selection_equals_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[[7, 70_000]] = math.nan
    for s in ({"method": "TopK", "k": 2_000}, {"method": "Threshold", "threshold": 2.0}):
        fast, plain = _both_paths(lambda s=s: Compressor(s).compress("w", x).indices, monkeypatch)
        assert torch.equal(fast, plain)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8, 12, 16, 24, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_blocked_quantization_equals_torch_path(bits: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(150_001, generator=torch.Generator().manual_seed(bits)).to(dtype)
    det = {"method": "Quantization", "bits": bits}

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        c = Compressor(det, stochastic_rounding=False).compress("w", x)
        return c.values, decompress(c)

    (p_fast, d_fast), (p_plain, d_plain) = _both_paths(run, monkeypatch)
    assert torch.equal(p_fast, p_plain)
    assert torch.equal(d_fast, d_plain)


@pytest.mark.usefixtures("plain_torch_path")
def test_torch_path_stochastic_rounding_unbiased() -> None:
    x = torch.randn(32, generator=torch.Generator().manual_seed(5)).double()
    comp = Compressor({"method": "Quantization", "bits": 3}, seed=0)
    draws = torch.stack([comp.roundtrip("w", x, step=s) for s in range(1500)])
    se = draws.std(0) / math.sqrt(draws.shape[0])
    assert bool(torch.all((draws.mean(0) - x).abs() <= 4 * se + 1e-12))
