"""Quantization maths, pure tensor functions: bit-packing of integer codes, min-max
quantization with counter-based stochastic rounding (the algebra:
:class:`~paratrain.compression.codecs.QuantizationCodec`), and the inverse.

Codes are **bit-packed** little-endian, least significant bit first: code i occupies
bits [i*b, (i+1)*b) of the payload, so n codes take exactly ceil(n*b/8) bytes
(4 bits: two codes per byte). Packing works on groups of 8/gcd(b, 8) codes that fill
b/gcd(b, 8) whole bytes, with one vectorised shift-or per (code, byte) overlap.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._kernels import BLOCK, numpy_view
from .wire import CompressionError


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits: ceil(n*bits/8)."""
    return (n * bits + 7) // 8


def _code_dtype(bits: int) -> torch.dtype:
    if bits <= 8:
        return torch.uint8
    if bits <= 16:
        return torch.int32
    return torch.int64


def _compute_dtype(bits: int, dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if bits > 16 or dtype == torch.float64 else torch.float32


def _overlaps(bits: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(codes per group, bytes per group, [(code i, byte j, shift = i*bits - 8j)])."""
    g = 8 // math.gcd(bits, 8)
    nbytes = bits * g // 8
    pairs = []
    for j in range(nbytes):
        for i in range(g):
            if i * bits < 8 * (j + 1) and (i + 1) * bits > 8 * j:
                pairs.append((i, j, i * bits - 8 * j))
    return g, nbytes, pairs


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) into ceil(n*bits/8) uint8 (LSB first)."""
    n = codes.numel()
    if bits == 8:
        return codes.to(torch.uint8)
    if bits in (16, 32):
        # A narrowing integer cast keeps the low bits; the byte view is little-endian.
        wide = codes.to(torch.int16 if bits == 16 else torch.int32)
        return wide.view(torch.uint8).reshape(-1)
    g, nbytes, pairs = _overlaps(bits)
    groups = -(-n // g)
    work_dtype = _code_dtype(bits)
    q = codes.to(work_dtype)
    if groups * g != n:
        q = torch.cat([q, q.new_zeros(groups * g - n)])
    q = q.view(groups, g)
    out = torch.zeros((groups, nbytes), dtype=work_dtype, device=codes.device)
    for i, j, shift in pairs:
        col = q[:, i]
        out[:, j] |= (col << shift) if shift >= 0 else (col >> -shift)
    if work_dtype != torch.uint8:
        out &= 0xFF
    return out.to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``n`` codes (uint8/int32/int64 by bit width)."""
    if packed.numel() != packed_nbytes(n, bits):
        raise CompressionError(
            f"quantized payload has {packed.numel()} bytes, expected {packed_nbytes(n, bits)}"
        )
    if bits == 8:
        return packed.clone()
    if bits == 16:
        return packed.view(torch.int16).to(torch.int32) & 0xFFFF
    if bits == 32:
        return packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    g, nbytes, pairs = _overlaps(bits)
    groups = -(-n // g)
    work_dtype = _code_dtype(bits)
    b = packed.to(work_dtype)
    if groups * nbytes != b.numel():
        b = torch.cat([b, b.new_zeros(groups * nbytes - b.numel())])
    b = b.view(groups, nbytes)
    out = torch.zeros((groups, g), dtype=work_dtype, device=packed.device)
    for i, j, shift in pairs:
        col = b[:, j]
        out[:, i] |= (col >> shift) if shift >= 0 else (col << -shift)
    out &= (1 << bits) - 1
    return out.reshape(-1)[:n]


class _CounterNoise:
    """Uniform noise u_i as a hash of (seed, i): a counter-based generator.

    w_j = lowbias32(j XOR s1) XOR s2 (Wellons' 32-bit integer hash; s1, s2 the two
    halves of the seed) gives 32 random bits per counter j, vectorised in cache with
    numpy. Up to 8 bits each word yields two 16-bit uniforms u = (h + 1/2) / 2^16 (finer
    than float32's resolution at 255); wider codes use one 24-bit (float32) or 32-bit
    (float64) uniform per word. E[u] = 1/2 exactly and P(u >= 1 - f) = f to within the
    grid step, so the rounding stays unbiased to the precision of the arithmetic. The
    noise of element i depends only on (seed, i), not on the block size.
    """

    def __init__(self, seed: int, bits: int, block: int, dtype: type) -> None:
        self.s1 = np.uint32(seed & 0xFFFFFFFF)
        self.s2 = np.uint32((seed >> 32) & 0xFFFFFFFF)
        self.per_word = 2 if bits <= 8 else 1
        words = -(-block // self.per_word)
        self.base = np.arange(words, dtype=np.uint32)
        self.h = np.empty(words, dtype=np.uint32)
        self.tmp = np.empty(words, dtype=np.uint32)
        self.dtype = dtype
        if self.per_word == 2:
            self.mult, self.half = 2.0**-16, 2.0**-17
        elif dtype == np.float32:
            self.mult, self.half = 2.0**-24, 2.0**-25
        else:
            self.mult, self.half = 2.0**-32, 2.0**-33

    def fill(self, start: int, m: int, out: np.ndarray) -> float:
        """u for elements start..start+m-1 (without the half step) into out[:m]."""
        words = -(-m // self.per_word)
        h, tmp = self.h[:words], self.tmp[:words]
        np.add(self.base[:words], np.uint32((start // self.per_word) & 0xFFFFFFFF), out=h)
        h ^= self.s1
        np.right_shift(h, 16, out=tmp)
        h ^= tmp
        h *= np.uint32(0x7FEB352D)
        np.right_shift(h, 15, out=tmp)
        h ^= tmp
        h *= np.uint32(0x846CA68B)
        np.right_shift(h, 16, out=tmp)
        h ^= tmp
        h ^= self.s2
        if self.per_word == 2:
            src: np.ndarray = h.view(np.uint16)[:m]
        elif self.dtype == np.float32:
            h >>= np.uint32(8)
            src = h
        else:
            src = h
        np.multiply(src, self.mult, out=out[:m], dtype=out.dtype)
        return self.half


_WORD = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _pack_small_block(b: np.ndarray, bits: int, small: np.ndarray, dst: np.ndarray) -> None:
    """Codes of 1, 2 or 4 bits (floats in ``b``) packed LSB first into ``dst``.

    The ``per = 8/bits`` codes of one output byte sit in consecutive bytes of one
    little-endian word v; OR-ing v >> i*(8 - bits) for i < per moves code i to bits
    [i*bits, (i+1)*bits) of the low byte, and the narrowing cast keeps that byte.
    """
    m = b.size
    per = 8 // bits
    nb = -(-m // per)
    codes = small[: nb * per]
    codes[m:] = 0
    codes[:m] = b  # float -> uint8 truncates: floor
    out = dst[:nb]
    if bits == 1:
        np.copyto(out, np.packbits(codes, bitorder="little"))
        return
    v = codes.view(_WORD[per])
    acc = v.copy()
    tmp = np.empty_like(v)
    for i in range(1, per):
        np.right_shift(v, i * (8 - bits), out=tmp)
        np.bitwise_or(acc, tmp, out=acc)
    np.copyto(out, acc, casting="unsafe")


def _unpack_small_block(src: np.ndarray, bits: int, codes: np.ndarray) -> None:
    """Inverse of :func:`_pack_small_block`: ``8/bits`` codes per byte into ``codes``."""
    if bits == 1:
        np.copyto(codes, np.unpackbits(src, bitorder="little"))
        return
    if bits == 4:  # spread the two nibbles of b into the two bytes of a uint16
        x = src.astype(np.uint16)
        x |= x << 4
        x &= 0x0F0F
    else:  # bits == 2: four 2-bit fields into the four bytes of a uint32
        x = src.astype(np.uint32)
        x |= x << 12
        x &= 0x000F000F
        x |= x << 6
        x &= 0x03030303
    np.copyto(codes, x.view(np.uint8))


def _quantize_blocked(
    xn: np.ndarray, bits: int, lo: float, inv: float, stochastic: bool, seed: int
) -> torch.Tensor:
    """Blocked CPU quantization straight into the packed payload (see _kernels)."""
    n = xn.size
    levels = float((1 << bits) - 1)
    cdt = np.float64 if bits > 16 or xn.dtype == np.float64 else np.float32
    packed = np.empty(packed_nbytes(n, bits), dtype=np.uint8)
    buf = np.empty(min(n, BLOCK), dtype=cdt)
    tmp = np.empty(min(n, BLOCK), dtype=cdt)
    wide = {16: np.uint16, 32: np.uint32}.get(bits)
    codes_out = packed.view(wide) if wide is not None else None
    small = np.empty(min(n, BLOCK) + 8, dtype=np.uint8 if bits <= 8 else np.int64)
    noise = _CounterNoise(seed, bits, min(n, BLOCK), cdt) if stochastic else None
    shift = (0.0 if stochastic else 0.5) - lo * inv
    for start in range(0, n, BLOCK):  # BLOCK is a multiple of 8: blocks end on bytes
        xc = xn[start : start + BLOCK]
        m = xc.size
        b = buf[:m]
        if noise is not None:
            half = noise.fill(start, m, buf)
            np.multiply(xc, inv, out=tmp[:m], dtype=cdt)
            np.add(b, tmp[:m], out=b)
            np.add(b, shift + half, out=b, dtype=cdt)
        else:
            np.multiply(xc, inv, out=b, dtype=cdt)
            np.add(b, shift, out=b, dtype=cdt)
        np.clip(b, 0.0, levels, out=b)
        # Casting a non-negative float to an integer truncates: floor(y).
        if bits == 8:
            packed[start : start + m] = b
        elif codes_out is not None:
            codes_out[start : start + m] = b
        elif 8 % bits == 0:
            _pack_small_block(b, bits, small, packed[start * bits // 8 :])
        else:
            small[:m] = b
            chunk = pack_codes(torch.from_numpy(small[:m]), bits)
            lo_byte = start * bits // 8
            packed[lo_byte : lo_byte + chunk.numel()] = chunk.numpy()
    return torch.from_numpy(packed)


def quantize_packed(
    flat: torch.Tensor, bits: int, *, stochastic: bool, seed: int
) -> tuple[torch.Tensor, float, float]:
    """Packed codes, lo and scale for a flat tensor; see the module docstring.

    The noise for stochastic rounding comes from ``seed``: a counter-based hash on the
    CPU fast path (:class:`_CounterNoise`), a torch generator on other devices and for
    bfloat16.
    """
    n = flat.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=flat.device), 0.0, 0.0
    lo_t, hi_t = torch.aminmax(flat)
    lo, hi = float(lo_t), float(hi_t)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CompressionError(
            f"cannot quantize a tensor with non-finite values (min={lo}, max={hi})"
        )
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    if scale == 0.0 or not math.isfinite(1.0 / scale):
        return torch.zeros(packed_nbytes(n, bits), dtype=torch.uint8, device=flat.device), lo, 0.0
    inv = 1.0 / scale
    xn = numpy_view(flat)
    if xn is not None:
        return _quantize_blocked(xn, bits, lo, inv, stochastic, seed), lo, scale
    cdt = _compute_dtype(bits, flat.dtype)
    # y = (x - lo)/s + r with r = u or 1/2; the cast truncates toward zero = floor, y >= 0.
    if stochastic:
        gen = torch.Generator(device=flat.device)
        gen.manual_seed(seed)
        y = torch.rand(n, generator=gen, dtype=cdt, device=flat.device)
        y.add_(flat, alpha=inv).add_(-lo * inv)
    else:
        y = torch.mul(flat, inv) if flat.dtype == cdt else flat.to(cdt).mul_(inv)
        y.add_(0.5 - lo * inv)
    y.clamp_(0.0, float(levels))
    return pack_codes(y.to(_code_dtype(bits)), bits), lo, scale


def dequantize(
    codes: torch.Tensor, lo: float, scale: float, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """lo + scale * codes, computed in float32 (float64 above 16 bits) and cast to dtype."""
    cdt = _compute_dtype(bits, dtype)
    y = codes.to(cdt)
    if scale != 0.0:
        y.mul_(scale)
    y.add_(lo)
    return y if cdt == dtype else y.to(dtype)


def dequantize_packed(
    packed: torch.Tensor, n: int, lo: float, scale: float, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """D(q) straight from the packed payload (flat, ``dtype``).

    On the CPU, widths 1, 2, 4, 8 and 16 decode block by block (unpack, scale, shift in
    cache) with the same float arithmetic as :func:`dequantize`, so both paths agree
    exactly.
    """
    if packed.numel() != packed_nbytes(n, bits):
        raise CompressionError(
            f"quantized payload has {packed.numel()} bytes, expected {packed_nbytes(n, bits)}"
        )
    probe = numpy_view(torch.empty(0, dtype=dtype)) if packed.device.type == "cpu" else None
    if probe is None or bits not in (1, 2, 4, 8, 16) or scale == 0.0 or n == 0:
        return dequantize(unpack_codes(packed, n, bits), lo, scale, bits, dtype)
    cdt = np.float64 if bits > 16 or dtype == torch.float64 else np.float32
    raw = packed.contiguous().numpy()
    out = np.empty(n, dtype=probe.dtype)
    direct = out.dtype == cdt
    fbuf = None if direct else np.empty(min(n, BLOCK), dtype=cdt)
    per = max(1, 8 // bits)
    codes_buf = np.empty(BLOCK, dtype=np.uint8) if bits < 8 else None
    wide = raw.view(np.uint16) if bits == 16 else None
    for start in range(0, n, BLOCK):
        m = min(BLOCK, n - start)
        if bits == 8:
            codes = raw[start : start + m]
        elif wide is not None:
            codes = wide[start : start + m]
        else:
            assert codes_buf is not None
            nb = -(-m // per)
            _unpack_small_block(raw[start // per : start // per + nb], bits, codes_buf[: nb * per])
            codes = codes_buf[:m]
        y = out[start : start + m] if direct else fbuf[:m]  # type: ignore[index]
        with np.errstate(all="ignore"):  # overflow gives inf, as on the torch path
            np.multiply(codes, scale, out=y, dtype=cdt)
            np.add(y, lo, out=y, dtype=cdt)
        if not direct:
            with np.errstate(all="ignore"):
                out[start : start + m] = y
    return torch.from_numpy(out)
