"""The versioned wire format of a :class:`CompressedTensor` (all integers little-endian).

Header (6 + 8*ndim bytes)::

    b"PT"  u8 version (=1)  u8 method  u8 dtype  u8 ndim  u64 dim[ndim]

method: 0 None, 1 TopK, 2 RandomK, 3 Threshold, 4 Quantization;
dtype: 0 float32, 1 float16, 2 bfloat16, 3 float64. Then, per method (n = prod(dims),
w = bytes per value at the dtype):

* None: ``n*w`` value bytes.
* TopK / Threshold: ``u8 encoding, u64 count`` then the positions, then ``count*w``
  value bytes in ascending position order. encoding 0 = ``count`` u32 indices, 2 =
  ``count`` u64 indices (only when n > 2^32), 1 = an n-bit bitmap (LSB first,
  ceil(n/8) bytes) -- the writer picks whichever is smaller.
* RandomK: ``u64 seed, u64 k`` then ``k*w`` value bytes; the positions are re-derived
  from the seed (:func:`randomk_positions`), so indices never travel.
* Quantization: ``u8 bits, u8 flags (bit 0: stochastic), f64 lo, f64 scale`` then
  ``ceil(n*bits/8)`` bytes of bit-packed codes.

The payload stays within a few dozen header bytes of :func:`information_minimum`.
:func:`parse` validates every field, the exact length, index order and padding before it
allocates anything sized by the payload; every failure is a :class:`CompressionError`, and
nothing is unpickled or evaluated.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from ._kernels import randomk_positions


class CompressionError(ValueError):
    """A compression input, state or wire payload that cannot be processed: malformed,
    truncated or hostile payloads (never a crash, a hang or an unbounded allocation),
    unsupported dtypes, state that does not match the tensors it is applied to."""


# the dtypes compression accepts, in the order of their wire codes
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16,
                                             torch.float64)
WIRE_VERSION = 1
MAGIC = b"PT"
MAX_NDIM = 16
DEFAULT_MAX_NUMEL = (1 << 31) - 1

_METHODS = ["None", "TopK", "RandomK", "Threshold", "Quantization"]
_METHOD_CODE = {m: i for i, m in enumerate(_METHODS)}
_DTYPE_CODE = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}
_ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}

_ENC_U32, _ENC_BITMAP, _ENC_U64 = 0, 1, 2
_HEAD = struct.Struct("<2sBBBB")
_SPARSE = struct.Struct("<BQ")
_RANDOMK = struct.Struct("<QQ")
_QUANT = struct.Struct("<BBdd")


def _sparse_encoding(n: int, count: int) -> tuple[int, int]:
    """(encoding, bytes for the positions): the smaller of indices and a bitmap."""
    width = 4 if n <= (1 << 32) else 8
    bitmap = (n + 7) // 8
    if bitmap < count * width:
        return _ENC_BITMAP, bitmap
    return (_ENC_U32 if width == 4 else _ENC_U64), count * width


# the bytes each method's record adds between the common header and its payload
_METHOD_HEAD = {"None": 0, "TopK": _SPARSE.size, "Threshold": _SPARSE.size,
                "RandomK": _RANDOMK.size, "Quantization": _QUANT.size}


def wire_nbytes(c: Any) -> int:
    """Exact ``len(to_bytes(c))`` without serialising."""
    head = _HEAD.size + 8 * len(c.shape) + _METHOD_HEAD.get(c.method, 0)
    if c.method in ("TopK", "Threshold"):
        count = int(c.values.numel())
        return head + _sparse_encoding(int(c.numel), count)[1] + count * _ITEMSIZE[c.dtype]
    return head + information_minimum(c)


def information_minimum(c: Any) -> int:
    """Bytes a header-free encoding needs (the benchmark's reference): None n*w; TopK /
    Threshold count*w + min(4*count, ceil(n/8)); RandomK k*w; Quantization ceil(n*bits/8)."""
    n, w = int(c.numel), _ITEMSIZE[c.dtype]
    if c.method == "None":
        return n * w
    if c.method in ("TopK", "Threshold"):
        count = int(c.values.numel())
        return count * w + min(4 * count, (n + 7) // 8)
    if c.method == "RandomK":
        return int(c.values.numel()) * w
    if c.method == "Quantization":
        return (n * int(c.bits) + 7) // 8
    raise CompressionError(f"unknown method {c.method!r}")


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def to_bytes(c: Any) -> bytes:
    """Serialise ``c``; ``len(to_bytes(c)) == wire_nbytes(c)``."""
    if c.method not in _METHOD_CODE:
        raise CompressionError(f"unknown method {c.method!r}")
    if c.dtype not in _DTYPE_CODE:
        raise CompressionError(f"unsupported dtype {c.dtype}")
    if len(c.shape) > MAX_NDIM:
        raise CompressionError(f"tensor rank {len(c.shape)} exceeds {MAX_NDIM}")
    parts = [
        _HEAD.pack(MAGIC, WIRE_VERSION, _METHOD_CODE[c.method], _DTYPE_CODE[c.dtype],
                   len(c.shape)),
        struct.pack(f"<{len(c.shape)}Q", *c.shape),
    ]
    n = c.numel
    if c.method in ("TopK", "Threshold"):
        assert c.indices is not None
        count = int(c.values.numel())
        enc, _ = _sparse_encoding(n, count)
        parts.append(_SPARSE.pack(enc, count))
        idx = c.indices.detach().to("cpu")
        if enc == _ENC_BITMAP:
            mask = np.zeros(n, dtype=np.bool_)
            mask[idx.numpy()] = True
            parts.append(np.packbits(mask, bitorder="little").tobytes())
        else:
            parts.append(_raw(idx.to(torch.int32 if enc == _ENC_U32 else torch.int64)))
    elif c.method == "RandomK":
        parts.append(_RANDOMK.pack(c.seed, int(c.values.numel())))
    elif c.method == "Quantization":
        parts.append(_QUANT.pack(c.bits, 1 if c.stochastic else 0, c.offset, c.scale))
    # Quantization's values are its packed uint8 codes; every other method's are at c.dtype.
    parts.append(_raw(c.values if c.method == "Quantization" else c.values.to(c.dtype)))
    return b"".join(parts)


class _Reader:
    """Bounds-checked cursor over a byte buffer."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.mv = memoryview(data).cast("B")
        self.pos = 0

    def remaining(self) -> int:
        return len(self.mv) - self.pos

    def take(self, nbytes: int, what: str) -> memoryview:
        if nbytes < 0 or nbytes > self.remaining():
            raise CompressionError(
                f"truncated payload: {what} needs {nbytes} bytes at offset {self.pos}, "
                f"{self.remaining()} left"
            )
        out = self.mv[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size, what))

    def tensor(self, count: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = self.take(count * itemsize, what)
        if count == 0:
            return torch.empty(0, dtype=dtype)
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
        return torch.from_numpy(arr).view(dtype)


def _check_indices(idx: torch.Tensor, n: int) -> None:
    if idx.numel() == 0:
        return
    if int(idx[0]) < 0 or int(idx[-1]) >= n:
        raise CompressionError(f"index out of range for a tensor of {n} elements")
    if idx.numel() > 1 and not bool(torch.all(idx[1:] > idx[:-1])):
        raise CompressionError("indices must be strictly increasing (sorted, no duplicates)")


def _fields(method: str, shape: tuple[int, ...], dtype: torch.dtype, values: torch.Tensor,
            **more: Any) -> dict[str, Any]:
    return {"method": method, "shape": shape, "dtype": dtype, "values": values, **more}


def parse(
    data: bytes | bytearray | memoryview,
    *,
    max_numel: int | None = None,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The fields of the :class:`~paratrain.compression.base.CompressedTensor` a payload of
    :func:`to_bytes` holds (CPU tensors), validated; ``max_numel`` bounds the declared element
    count (default 2^31 - 1), ``expect_shape``/``expect_dtype`` reject another tensor's."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CompressionError(f"expected bytes, got {type(data).__name__}")
    r = _Reader(data)
    method, shape, dtype, n = _parse_header(r, DEFAULT_MAX_NUMEL if max_numel is None else max_numel)
    if expect_shape is not None and tuple(expect_shape) != shape:
        raise CompressionError(f"payload shape {shape} != expected {tuple(expect_shape)}")
    if expect_dtype is not None and expect_dtype != dtype:
        raise CompressionError(f"payload dtype {dtype} != expected {expect_dtype}")
    if method == "None":
        out = _fields("None", shape, dtype, r.tensor(n, dtype, "values"))
    elif method in ("TopK", "Threshold"):
        out = _parse_sparse(r, method, shape, dtype, n)
    elif method == "RandomK":
        out = _parse_randomk(r, shape, dtype, n)
    else:
        out = _parse_quantized(r, shape, dtype, n)
    if r.remaining():
        raise CompressionError(f"{r.remaining()} trailing bytes after the payload")
    return out


def _parse_header(r: _Reader, limit: int) -> tuple[str, tuple[int, ...], torch.dtype, int]:
    """The common header: method, shape, dtype and element count, each validated."""
    magic, version, method_code, dtype_code, ndim = r.unpack(_HEAD, "header")
    if magic != MAGIC:
        raise CompressionError(f"bad magic {magic!r}: not a paratrain compressed tensor")
    if version != WIRE_VERSION:
        raise CompressionError(f"unsupported wire version {version} (this build reads 1)")
    if method_code >= len(_METHODS):
        raise CompressionError(f"unknown method code {method_code}")
    if dtype_code >= len(SUPPORTED_DTYPES):
        raise CompressionError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise CompressionError(f"tensor rank {ndim} exceeds {MAX_NDIM}")
    shape = tuple(int(d) for d in struct.unpack(f"<{ndim}Q", r.take(8 * ndim, "shape")))
    n = 1
    for d in shape:
        n *= d
        if n > limit or d > limit:
            raise CompressionError(f"declared shape {shape} exceeds max_numel={limit}")
    return _METHODS[method_code], shape, SUPPORTED_DTYPES[dtype_code], n


def _parse_sparse(r: _Reader, method: str, shape: tuple[int, ...], dtype: torch.dtype,
                  n: int) -> dict[str, Any]:
    enc, count = r.unpack(_SPARSE, "sparse header")
    if count > n:
        raise CompressionError(f"count {count} exceeds the tensor's {n} elements")
    if enc == _ENC_BITMAP:
        raw = r.take((n + 7) // 8, "bitmap")
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        if bits[n:].any():
            raise CompressionError("bitmap has bits set beyond the tensor's length")
        idx = torch.from_numpy(np.flatnonzero(bits[:n]).astype(np.int64))
        if idx.numel() != count:
            raise CompressionError(
                f"bitmap marks {idx.numel()} positions but count says {count}"
            )
    elif enc in (_ENC_U32, _ENC_U64):
        if enc == _ENC_U32:
            idx = r.tensor(count, torch.int32, "indices").to(torch.int64) & 0xFFFFFFFF
        else:
            idx = r.tensor(count, torch.int64, "indices")
        _check_indices(idx, n)
    else:
        raise CompressionError(f"unknown sparse encoding {enc}")
    values = r.tensor(count, dtype, "values")
    return _fields(method, shape, dtype, values, indices=idx)


def _parse_randomk(r: _Reader, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> dict[str, Any]:
    seed, k = r.unpack(_RANDOMK, "RandomK header")
    if k > n:
        raise CompressionError(f"RandomK k={k} exceeds the tensor's {n} elements")
    if seed >= 1 << 63:
        raise CompressionError(f"RandomK seed {seed} out of range")
    # Length first: never spend work re-deriving positions for a truncated payload.
    w = _ITEMSIZE[dtype]
    if r.remaining() != k * w:
        raise CompressionError(
            f"RandomK payload has {r.remaining()} value bytes, expected {k * w}"
        )
    values = r.tensor(k, dtype, "values")
    idx = randomk_positions(n, k, seed)
    return _fields("RandomK", shape, dtype, values, indices=idx, seed=seed, k=k)


def _parse_quantized(r: _Reader, shape: tuple[int, ...], dtype: torch.dtype,
                     n: int) -> dict[str, Any]:
    qbits, flags, lo, scale = r.unpack(_QUANT, "quantization header")
    if not 1 <= qbits <= 32:
        raise CompressionError(f"quantization bits {qbits} not in 1..32")
    if flags & ~1:
        raise CompressionError(f"unknown quantization flags {flags:#x}")
    if not (math.isfinite(lo) and math.isfinite(scale)) or scale < 0:
        raise CompressionError(f"invalid quantization parameters lo={lo}, scale={scale}")
    top = lo + scale * ((1 << qbits) - 1)
    fmax = torch.finfo(dtype).max * (1 + torch.finfo(dtype).eps)
    if not math.isfinite(top) or max(abs(lo), abs(top)) > fmax:
        raise CompressionError(f"quantization range [{lo}, {top}] overflows {dtype}")
    nbytes = (n * qbits + 7) // 8
    packed = r.tensor(nbytes, torch.uint8, "quantized codes")
    spare = nbytes * 8 - n * qbits
    if spare and int(packed[-1]) >> (8 - spare):
        raise CompressionError("padding bits of the last quantized byte are not zero")
    return _fields(
        "Quantization", shape, dtype, packed, bits=qbits, offset=lo, scale=scale,
        stochastic=bool(flags & 1),
    )
