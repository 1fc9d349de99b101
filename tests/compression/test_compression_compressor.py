"""Compressor: construction, statistics, state_dict resume, composition."""

from __future__ import annotations

import io
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.comm.ddp_hook import allreduce_compressed
from paratrain.compression import (
    CompressedTensor,
    CompressionError,
    CompressionStats,
    Compressor,
    decompress,
    leaf_method,
)
from paratrain.config import ConfigError, ErrorFeedback, TopK

STATEFUL = [
    {"method": "ErrorFeedback", "error_compensation": True,
     "base_strategy": {"method": "RandomK", "k": 7}},
    {"method": "ErrorFeedback", "error_compensation": True,
     "base_strategy": {"method": "Quantization", "bits": 3}},
    {"method": "ErrorFeedback", "error_compensation": True,
     "base_strategy": {"method": "ErrorFeedback", "error_compensation": True,
                       "base_strategy": {"method": "ClippedCompression", "clip_value": 0.5,
                                         "base_strategy": {"method": "TopK", "k": 5}}}},
]


def test_construction_forms_agree() -> None:
    doc = {"method": "ErrorFeedback", "error_compensation": True,
           "base_strategy": {"method": "TopK", "k": 2}}
    x = torch.randn(10, generator=torch.Generator().manual_seed(0))
    outs = [
        Compressor(s).roundtrip("w", x)
        for s in (doc, json.dumps(doc), ErrorFeedback(base_strategy=TopK(k=2), error_compensation=True))
    ]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert leaf_method(doc) == "TopK" and Compressor().method == "None"
    with pytest.raises(ConfigError, match="method"):
        Compressor({"method": "TopQ", "k": 1})


def test_stats_follow_the_rust_vectors_and_count_wire_bytes() -> None:
    s = CompressionStats()
    assert s.ratio == 1.0
    s.record(1000, 500)
    assert (s.ratio, s.savings) == (0.5, 50.0)
    s.record(1000, 250)
    assert (s.ratio, s.savings, s.best_ratio, s.worst_ratio) == (0.375, 62.5, 0.25, 0.5)
    comp = Compressor({"method": "TopK", "k": 10})
    a = comp.compress("a", torch.randn(1000))
    b = comp.compress("b", torch.randn(100, dtype=torch.float16))
    assert comp.key_stats["a"].original_bytes == 4000
    assert comp.key_stats["b"].original_bytes == 200
    assert comp.stats.compressed_bytes == len(a.to_bytes()) + len(b.to_bytes())
    assert comp.stats.count == 2
    assert 0 < comp.stats_dict()["ratio"] < 0.2
    assert set(comp.stats_dict()["per_key"]) == {"a", "b"}
    comp.reset_stats()
    assert comp.stats.count == 0 and not comp.key_stats


@pytest.mark.parametrize("strategy", STATEFUL, ids=["EF-RandomK", "EF-Quant", "EF-EF-Clip-TopK"])
def test_state_dict_resume_continues_exactly(strategy: dict) -> None:
    g = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)} for _ in range(8)]

    def run(comp: Compressor, steps: list[dict]) -> list[torch.Tensor]:
        out = []
        for gs in steps:
            out += [comp.roundtrip(k, v) for k, v in gs.items()]
            comp.step()
        return out

    straight = Compressor(strategy, seed=3)
    expected = run(straight, grads)
    first = Compressor(strategy, seed=3)
    got = run(first, grads[:4])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = Compressor(strategy, seed=3)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.current_step == 4
    got += run(resumed, grads[4:])
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert resumed.stats.count == straight.stats.count
    # Non-vacuity: a fresh compressor (no residuals, step 0) diverges.
    fresh = run(Compressor(strategy, seed=3), grads[4:])
    assert any(not torch.equal(a, b) for a, b in zip(fresh, expected[len(got) - len(fresh):], strict=True))


def test_load_state_dict_rejects_mismatches() -> None:
    comp = Compressor({"method": "TopK", "k": 1})
    with pytest.raises(CompressionError, match="strategy"):
        comp.load_state_dict(Compressor({"method": "TopK", "k": 2}).state_dict())
    with pytest.raises(CompressionError, match="version"):
        comp.load_state_dict({"version": 99})
    ef = Compressor(STATEFUL[0])
    bad = ef.state_dict()
    bad["codec"]["residuals"] = {"w": "not a tensor"}
    with pytest.raises(CompressionError, match="residuals"):
        ef.load_state_dict(bad)


def test_step_argument_and_counter() -> None:
    comp = Compressor({"method": "RandomK", "k": 3}, seed=1)
    x = torch.randn(50)
    a = comp.compress("w", x).indices
    assert comp.step() == 1
    b = comp.compress("w", x).indices
    assert torch.equal(comp.compress("w", x, step=0).indices, a)
    assert not torch.equal(a, b)
    assert not torch.equal(Compressor({"method": "RandomK", "k": 3}, seed=2).compress("w", x).indices, a)


def test_roundtrip_does_not_alias_input() -> None:
    x = torch.randn(20)
    for s in ({"method": "None"}, {"method": "TopK", "k": 20}):
        out = Compressor(s).roundtrip("w", x)
        out.add_(1.0)
        assert not torch.equal(out, x)


# --------------------------------------------------------------------------- compositions

leaves = st.one_of(
    st.just({"method": "None"}),
    st.builds(lambda k: {"method": "TopK", "k": k}, st.integers(1, 30)),  # k = 0 is an error
    st.builds(lambda k: {"method": "RandomK", "k": k}, st.integers(1, 30)),
    st.builds(lambda t: {"method": "Threshold", "threshold": t}, st.floats(0, 2)),
    st.builds(lambda b: {"method": "Quantization", "bits": b}, st.integers(1, 32)),
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.builds(lambda b, ec: {"method": "ErrorFeedback", "base_strategy": b,
                                 "error_compensation": ec}, inner, st.booleans()),
        st.builds(lambda b, c: {"method": "ClippedCompression", "base_strategy": b,
                                "clip_value": c}, inner, st.floats(0.1, 3)),
    ),
    max_leaves=4,
)


@given(trees, st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
@settings(max_examples=120)
def test_any_composition_round_trips_and_resumes(strategy: dict, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 6, generator=g).to(dtype) for _ in range(4)]
    a = Compressor(strategy, seed=1)
    outs = []
    for i, x in enumerate(xs):
        c = a.compress("w", x)
        back = CompressedTensor.from_bytes(c.to_bytes(), expect_shape=(4, 6), expect_dtype=dtype)
        d = decompress(back)
        assert torch.equal(d, decompress(c)) and d.dtype == dtype
        outs.append(d)
        a.step()
        if i == 1:
            saved = a.state_dict()
    b = Compressor(strategy, seed=1)
    b.load_state_dict(saved)
    for x, expected in zip(xs[2:], outs[2:], strict=True):
        assert torch.equal(b.roundtrip("w", x), expected)
        b.step()


def test_allreduce_compressed_single_process_is_the_roundtrip() -> None:
    x = torch.randn(30, generator=torch.Generator().manual_seed(0))
    for s in ({"method": "TopK", "k": 4}, {"method": "RandomK", "k": 4},
              {"method": "Threshold", "threshold": 1.0}, {"method": "Quantization", "bits": 4},
              {"method": "None"}):
        (got,) = allreduce_compressed(Compressor(s, seed=2), [("x", x)])
        assert torch.equal(got, Compressor(s, seed=2).roundtrip("x", x))
