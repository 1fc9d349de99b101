"""The wire format: round trips, exact sizes, strict validation and a decoder fuzz."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.compression import (
    CompressedTensor,
    CompressionError,
    Compressor,
    decompress,
    information_minimum,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
METHODS = [
    {"method": "None"},
    {"method": "TopK", "k": 3},
    {"method": "TopK", "k": 40},  # dense enough for the bitmap encoding
    {"method": "RandomK", "k": 5},
    {"method": "Threshold", "threshold": 0.5},
    {"method": "Quantization", "bits": 1},
    {"method": "Quantization", "bits": 5},
    {"method": "Quantization", "bits": 8},
    {"method": "Quantization", "bits": 13},
    {"method": "Quantization", "bits": 32},
    {"method": "ErrorFeedback", "error_compensation": True,
     "base_strategy": {"method": "ClippedCompression", "clip_value": 0.3,
                       "base_strategy": {"method": "TopK", "k": 4}}},
]
SHAPES = [(6, 8), (0,), (), (3, 1, 5)]


def _head(ndim: int) -> int:
    return 6 + 8 * ndim


@pytest.mark.parametrize("strategy", METHODS, ids=lambda s: f"{s['method']}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_method_and_dtype(strategy: dict, dtype: torch.dtype, shape: tuple) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    c = Compressor(strategy, seed=4).compress("k", x)
    blob = c.to_bytes()
    assert len(blob) == c.nbytes
    back = CompressedTensor.from_bytes(blob, expect_shape=tuple(shape), expect_dtype=dtype)
    assert (back.method, back.shape, back.dtype) == (c.method, c.shape, c.dtype)
    d0, d1 = decompress(c), decompress(back)
    assert d1.dtype == dtype and d1.shape == x.shape
    assert torch.equal(d0, d1)
    assert back.to_bytes() == blob


@pytest.mark.parametrize("strategy,extra", [
    ({"method": "None"}, 0), ({"method": "TopK", "k": 10_000}, 9),
    ({"method": "Threshold", "threshold": 2.0}, 9), ({"method": "RandomK", "k": 10_000}, 16),
    ({"method": "Quantization", "bits": 4}, 18), ({"method": "Quantization", "bits": 7}, 18),
])
def test_wire_size_is_header_plus_information_minimum(strategy: dict, extra: int) -> None:
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    c = Compressor(strategy).compress("k", x)
    assert c.nbytes == information_minimum(c) + _head(1) + extra
    assert c.nbytes <= 1.01 * information_minimum(c)


def test_sparse_encoding_picks_the_smaller_of_indices_and_bitmap() -> None:
    x = torch.randn(800, generator=torch.Generator().manual_seed(0))
    sparse = Compressor({"method": "TopK", "k": 20}).compress("k", x)
    dense = Compressor({"method": "TopK", "k": 400}).compress("k", x)
    assert sparse.nbytes == _head(1) + 9 + 20 * 4 + 20 * 4  # u32 indices
    assert dense.nbytes == _head(1) + 9 + 100 + 400 * 4  # 800-bit bitmap
    assert sparse.to_bytes()[_head(1)] == 0 and dense.to_bytes()[_head(1)] == 1


# --------------------------------------------------------------------------- hostile
def _header(method: int, dtype: int, dims: tuple[int, ...], version: int = 1) -> bytes:
    return struct.pack("<2sBBBB", b"PT", version, method, dtype, len(dims)) + struct.pack(
        f"<{len(dims)}Q", *dims
    )


def _sparse(dims: tuple[int, ...], enc: int, count: int, rest: bytes) -> bytes:
    return _header(1, 0, dims) + struct.pack("<BQ", enc, count) + rest


def _quant(n: int, bits: int, flags: int, lo: float, scale: float, payload: bytes) -> bytes:
    return _header(4, 0, (n,)) + struct.pack("<BBdd", bits, flags, lo, scale) + payload


HOSTILE = {
    "empty": (b"", "truncated"),
    "bad magic": (b"XX\x01\x00\x00\x00", "magic"),
    "future version": (_header(0, 0, (1,), version=2) + b"\0" * 4, "version"),
    "unknown method": (_header(9, 0, (1,)), "method code"),
    "unknown dtype": (_header(0, 7, (1,)), "dtype code"),
    "rank too high": (struct.pack("<2sBBBB", b"PT", 1, 0, 0, 200), "rank"),
    "huge shape": (_header(0, 0, (1 << 40,)), "max_numel"),
    "product overflow": (_header(1, 0, (1 << 20,) * 4), "max_numel"),
    "truncated dims": (_header(0, 0, (4, 4))[:-3], "truncated"),
    "truncated values": (_header(0, 0, (4,)) + b"\0" * 15, "truncated"),
    "trailing": (_header(0, 0, (1,)) + b"\0" * 5, "trailing"),
    "count > n": (_sparse((4,), 0, 5, b""), "count"),
    "huge count": (_sparse((1 << 30,), 0, 1 << 29, b"\0" * 8), "truncated"),
    "bad encoding": (_sparse((4,), 7, 1, b"\0" * 8), "encoding"),
    "index out of range": (_sparse((4,), 0, 1, struct.pack("<I", 4) + b"\0" * 4), "range"),
    "unsorted": (_sparse((4,), 0, 2, struct.pack("<II", 2, 1) + b"\0" * 8), "increasing"),
    "duplicate": (_sparse((4,), 0, 2, struct.pack("<II", 1, 1) + b"\0" * 8), "increasing"),
    "bitmap beyond n": (_sparse((4,), 1, 1, b"\x10" + b"\0" * 4), "beyond"),
    "bitmap count": (_sparse((4,), 1, 1, b"\x03" + b"\0" * 4), "count says"),
    "randomk k > n": (_header(2, 0, (4,)) + struct.pack("<QQ", 1, 5), "exceeds"),
    "randomk huge k short": (_header(2, 0, ((1 << 31) - 1,)) + struct.pack("<QQ", 1, (1 << 31) - 2), "value bytes"),
    "randomk seed": (_header(2, 0, (4,)) + struct.pack("<QQ", 1 << 63, 0), "seed"),
    "quant bits 0": (_quant(4, 0, 0, 0.0, 1.0, b""), "bits"),
    "quant bits 33": (_quant(4, 33, 0, 0.0, 1.0, b"\0" * 17), "bits"),
    "quant nan scale": (_quant(4, 8, 0, 0.0, float("nan"), b"\0" * 4), "parameters"),
    "quant negative scale": (_quant(4, 8, 0, 0.0, -1.0, b"\0" * 4), "parameters"),
    "quant inf lo": (_quant(4, 8, 0, float("inf"), 1.0, b"\0" * 4), "parameters"),
    "quant overflow": (_quant(4, 32, 0, 1e308, 1e300, b"\0" * 16), "overflows"),
    "quant flags": (_quant(4, 8, 6, 0.0, 1.0, b"\0" * 4), "flags"),
    "quant padding": (_quant(3, 3, 0, 0.0, 1.0, b"\0\x80"), "padding"),
    "quant truncated": (_quant(8, 4, 0, 0.0, 1.0, b"\0" * 3), "truncated"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_payloads_raise_compression_error(name: str) -> None:
    blob, match = HOSTILE[name]
    t0 = time.thread_time()  # CPU time: robust to a busy machine
    with pytest.raises(CompressionError, match=match):
        CompressedTensor.from_bytes(blob)
    assert time.thread_time() - t0 < 0.5  # rejected before any work sized by the header


def test_expectations_and_limits() -> None:
    blob = Compressor({"method": "TopK", "k": 2}).compress("k", torch.randn(3, 4)).to_bytes()
    with pytest.raises(CompressionError, match="shape"):
        CompressedTensor.from_bytes(blob, expect_shape=(4, 3))
    with pytest.raises(CompressionError, match="dtype"):
        CompressedTensor.from_bytes(blob, expect_dtype=torch.float16)
    with pytest.raises(CompressionError, match="max_numel"):
        CompressedTensor.from_bytes(blob, max_numel=11)
    assert CompressedTensor.from_bytes(bytearray(blob), max_numel=12).shape == (3, 4)
    with pytest.raises(CompressionError, match="bytes"):
        CompressedTensor.from_bytes("not bytes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- fuzz
def _valid_payloads() -> list[bytes]:
    out = []
    g = torch.Generator().manual_seed(0)
    for i, s in enumerate(METHODS):
        for dtype in (torch.float32, torch.float16):
            for shape in ((5, 9), (17,)):
                x = torch.randn(shape, generator=g).to(dtype)
                out.append(Compressor(s, seed=i).compress("k", x).to_bytes())
    return out


VALID = _valid_payloads()
mutation = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 400)),
    st.tuples(st.just("flip"), st.integers(0, 400), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 400), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("insert"), st.integers(0, 400), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("delete"), st.integers(0, 400), st.integers(1, 12)),
)


def _mutate(blob: bytes, op: tuple) -> bytes:
    b = bytearray(blob)
    pos = op[1] % (len(b) + 1)
    if op[0] == "truncate":
        return bytes(b[:pos])
    if op[0] == "flip" and pos < len(b):
        b[pos] ^= op[2]
    elif op[0] == "set":
        b[pos : pos + len(op[2])] = op[2]
    elif op[0] == "insert":
        b[pos:pos] = op[2]
    elif op[0] == "delete":
        del b[pos : pos + op[2]]
    return bytes(b)


def _decode_or_reject(blob: bytes) -> None:
    try:
        c = CompressedTensor.from_bytes(blob, max_numel=4096)
    except CompressionError as e:
        assert str(e)
        return
    d = decompress(c)  # anything accepted must decode to its declared shape
    assert tuple(d.shape) == c.shape and d.dtype == c.dtype
    assert len(c.to_bytes()) == c.nbytes


@given(st.integers(0, len(VALID) - 1), st.lists(mutation, min_size=1, max_size=3))
@settings(max_examples=600)  # ~27 ms each; with the random-bytes and header fuzz below
def test_fuzz_mutated_payloads(which: int, ops: list) -> None:
    blob = VALID[which]
    for op in ops:
        blob = _mutate(blob, op)
    _decode_or_reject(blob)


@given(st.binary(max_size=120))
@settings(max_examples=300)
def test_fuzz_random_bytes(tail: bytes) -> None:
    _decode_or_reject(tail)
    _decode_or_reject(b"PT\x01" + tail)


def test_fuzz_random_header_fields() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        method, dtype, ndim = (int(v) for v in rng.integers(0, 6, 3))
        dims = tuple(int(d) for d in rng.integers(0, 9, ndim))
        body = rng.integers(0, 256, int(rng.integers(0, 80)), dtype=np.uint8).tobytes()
        _decode_or_reject(_header(method, dtype, dims) + body)


def test_fuzz_reaches_both_outcomes() -> None:
    # Non-vacuity for the fuzz: mutations are sometimes accepted and sometimes rejected.
    rng = np.random.default_rng(1)
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(1000):
        blob = VALID[int(rng.integers(len(VALID)))]
        op = ("flip", int(rng.integers(400)), int(rng.integers(1, 256)))
        blob = _mutate(blob, op)
        try:
            CompressedTensor.from_bytes(blob, max_numel=4096).decompress()
            outcomes["ok"] += 1
        except CompressionError:
            outcomes["rejected"] += 1
    assert outcomes["ok"] > 50 and outcomes["rejected"] > 50, outcomes
