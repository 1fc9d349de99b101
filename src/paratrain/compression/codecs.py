"""One codec per CompressionStrategy method, and :func:`build_codec`, which turns a strategy
into a tree of them (wrappers around one leaf).

A leaf (None, TopK, RandomK, Threshold, Quantization) returns its own
:class:`CompressedTensor`; a wrapper (ErrorFeedback, ClippedCompression) transforms the
input or keeps state and returns its base's record, so wrappers compose to any depth,
e.g. ``ErrorFeedback(ClippedCompression(TopK))``. Each class states its algebra.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.compression import (
    ClippedCompression,
    ErrorFeedback,
    NoCompression,
    PowerSGD,
    Quantization,
    RandomK,
    Threshold,
    TopK,
    load_compression,
)
from ._kernels import randomk_positions, threshold_indices, topk_indices
from .base import Codec, CompressedTensor, EncodeContext, decompress
from .powersgd import PowerSGDState
from .quant_kernels import quantize_packed
from .wire import CompressionError


class _Stateless:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class NoneCodec(_Stateless):
    """``{"method":"None"}``: the identity, C(x) = x. The wire carries all n values at the
    input dtype (the information minimum of an uncompressed tensor)."""

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        return CompressedTensor("None", shape, flat.dtype, flat.clone())


class _KeepK(_Stateless):
    def __init__(self, k: int) -> None:
        self.k = k  # >= 1: the contract (config.compression) refuses less


class TopKCodec(_KeepK):
    """``{"method":"TopK","k":k}``: keep the ``min(k, n)`` entries of largest magnitude.

    Per tensor, C(x)_i = x_i if i is among the k largest |x_i|, else 0, so
    ||x - C(x)||^2 <= (1 - k/n) ||x||^2 (the k largest squares are at least a k/n share of
    the sum). Ties at the k-th magnitude are broken by the lower flat index (the Rust
    reference's stable sort gives the same set); NaN counts as the largest magnitude, as in
    ``torch.topk``. Kept indices are returned in ascending order (:func:`topk_indices`).
    """

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        idx = topk_indices(flat, self.k)
        return CompressedTensor("TopK", shape, flat.dtype, flat[idx], idx)


class RandomKCodec(_KeepK):
    """``{"method":"RandomK","k":k}``: keep ``min(k, n)`` uniformly random positions.

    C(x)_i = x_i for i in S, else 0, where S is a uniform random k-subset of {0..n-1} drawn
    from a generator seeded by ``derive_seed(seed, step, key)``. Every rank computes the same
    S for the same (seed, step, key), so only the k values travel (Stich et al., "Sparsified
    SGD with memory", NeurIPS 2018) and ranks can all-reduce them directly. Values are not
    rescaled by n/k (the Rust reference does not rescale either); E[C(x)] = (k/n) x, and
    ErrorFeedback removes that bias over time.

    The subset is drawn with numpy's ``Generator.choice(n, k, replace=False)`` on a PCG64
    stream seeded by that value (Floyd's algorithm with a hash set when k << n, a partial
    shuffle otherwise: both uniform k-subsets), on the CPU, so every rank and every device
    type draws the same positions.
    """

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        seed = ctx.derived_seed("RandomK")
        idx = randomk_positions(flat.numel(), self.k, seed).to(flat.device)
        return CompressedTensor(
            "RandomK", shape, flat.dtype, flat[idx], idx, seed=seed, k=int(idx.numel())
        )


class ThresholdCodec(_Stateless):
    """``{"method":"Threshold","threshold":t}``: keep the entries with |x_i| > t (strict).

    C(x)_i = x_i if |x_i| > t else 0; NaN entries are kept (their magnitude is not <= t).
    One cache-blocked pass (:func:`abs_above_indices`; ``hardshrink`` + ``nonzero`` off the
    CPU) lists the survivors in ascending order. The number kept varies per tensor
    and per rank, so in data parallelism the records travel by all-gather.
    (Strom, "Scalable distributed DNN training using commodity GPU cloud computing", 2015.)
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = float(threshold)  # finite, >= 0 (the contract)

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        idx = threshold_indices(flat, self.threshold)
        return CompressedTensor("Threshold", shape, flat.dtype, flat[idx], idx)


class QuantizationCodec(_Stateless):
    """``{"method":"Quantization","bits":b}``: per-tensor min-max uniform quantization, packed.

    With lo = min(x), hi = max(x), L = 2^b - 1 levels and s = (hi - lo) / L, each value
    maps to a code q_i in {0..L} and back to D(q)_i = lo + s q_i:

    * stochastic rounding (default): q_i = floor((x_i - lo)/s + u_i), u_i ~ U[0, 1), so
      E[D(q)_i] = x_i (unbiased) and |D(q)_i - x_i| < s (QSGD, Alistarh et al., NeurIPS
      2017; Gupta et al., "Deep learning with limited numerical precision", ICML 2015);
    * deterministic: q_i = floor((x_i - lo)/s + 1/2), |D(q)_i - x_i| <= s/2.

    A constant tensor has s = 0 and decodes exactly. Non-finite inputs cannot be quantized
    and raise :class:`CompressionError`. The noise is a function of derive_seed(seed, step,
    key) only (a counter-based hash of the element index on the CPU, a seeded torch
    generator on other devices), so a resumed run draws the same noise. On the CPU both
    directions run block by block in cache, bit-identical to the plain torch path for
    deterministic rounding (tested). Codes are bit-packed: :mod:`.quant_kernels`.
    """

    def __init__(self, bits: int, *, stochastic: bool = True) -> None:
        if not 1 <= bits <= 32:
            raise ValueError(f"Quantization.bits must be in 1..32, got {bits}")
        self.bits = bits
        self.stochastic = stochastic

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        packed, lo, scale = quantize_packed(
            flat, self.bits, stochastic=self.stochastic, seed=ctx.derived_seed("Quantization")
        )
        return CompressedTensor(
            "Quantization", shape, flat.dtype, packed,
            bits=self.bits, offset=lo, scale=scale, stochastic=self.stochastic,
        )


_SPARSE = ("TopK", "RandomK", "Threshold")


class ErrorFeedbackCodec:
    """``{"method":"ErrorFeedback","base_strategy":B,"error_compensation":bool}``.

    Error feedback (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al.,
    "Error feedback fixes SignSGD", ICML 2019; Stich et al., NeurIPS 2018) keeps a residual
    e per key and compresses the compensated input:

        p_t = g_t + e_{t-1};   c_t = B(p_t);   e_t = p_t - D(c_t)

    so nothing is lost, only delayed: sum_{t<=T} D(c_t) + e_T = sum_{t<=T} g_t (telescoping,
    e_0 = 0). With ``error_compensation=false`` the residual is still tracked
    (e_t = g_t - D(B(g_t)), readable through ``Compressor.residual``) but not added back, so the
    output equals B's. (The Rust reference never reads the flag and updates e from g
    instead of p; this class implements the textbook algebra.)

    Residuals live on the input's device, in float32 for float16/bfloat16 inputs (so small
    corrections are not rounded away) and at the input dtype otherwise. The compensated p
    is cast back to the input dtype before B runs, and the cast's rounding stays in e.
    """

    def __init__(self, base: Codec, error_compensation: bool = True) -> None:
        self.base = base
        self.error_compensation = error_compensation
        self.residuals: dict[str, torch.Tensor] = {}  # key -> flat e, updated in place

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        rdt = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
        e = self.residuals.get(ctx.key)
        if e is not None and (e.numel() != flat.numel() or e.dtype != rdt):
            raise CompressionError(
                f"error-feedback residual for key {ctx.key!r} has {e.numel()} elements of "
                f"{e.dtype}; the tensor has {flat.numel()} of {flat.dtype} (a key must always "
                "name the same tensor)"
            )
        if self.error_compensation and e is not None:
            # Accumulate in the residual's own buffer (no fresh allocation): it becomes p,
            # and below e_t = p - D(c). Leaves copy what they keep, never alias p.
            p = e if e.device == flat.device else e.to(flat.device)
            p.add_(flat)
        else:
            p = flat.to(rdt, copy=True)
        c = self.base.encode(p if p.dtype == flat.dtype else p.to(flat.dtype), shape, ctx)
        if c.indices is not None and c.method in _SPARSE:
            # D(c) is zero except at the (distinct) kept indices: e = p - D(c) in O(k).
            p.index_add_(0, c.indices.to(p.device), c.values.to(rdt), alpha=-1)
        else:
            dense = decompress(c)
            # Keep the decoded tensor so Compressor.roundtrip need not decode twice.
            c._cache["dense"] = dense
            p.sub_(dense.reshape(-1).to(rdt))
        self.residuals[ctx.key] = p
        return c

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
            "base": self.base.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residuals = state.get("residuals", {})
        if not isinstance(residuals, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in residuals.items()
        ):
            raise CompressionError("ErrorFeedback state: 'residuals' must map str -> Tensor")
        self.residuals = {k: v.detach().clone().reshape(-1) for k, v in residuals.items()}
        self.base.load_state_dict(state.get("base", {}))


class ClippedCodec:
    """``{"method":"ClippedCompression","base_strategy":B,"clip_value":c}``.

    C(x) = B(clamp(x, -c, c)): each value is clamped element-wise (by value, not by norm,
    as in the Rust reference) before the base method runs. NaN passes through the clamp
    unchanged. The record is the base method's; clipping never appears on the wire.
    """

    def __init__(self, base: Codec, clip_value: float) -> None:
        self.base = base  # clip_value: finite, > 0 (the contract)
        self.clip_value = float(clip_value)

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        return self.base.encode(flat.clamp(-self.clip_value, self.clip_value), shape, ctx)

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state.get("base", {}))


class PowerSGDCodec:
    """PowerSGD inside a :class:`Compressor`: not a per-tensor codec (its two all-reduces
    sit in the middle of the compression), so ``encode`` refuses; the state (residuals,
    warm Q, step) is :class:`~paratrain.compression.powersgd.PowerSGDState`, which the
    all-reduce paths in ``comm/`` drive."""

    def __init__(self, state: PowerSGDState) -> None:
        self.state = state

    def encode(self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext) -> CompressedTensor:
        raise CompressionError(
            "PowerSGD is not a per-tensor codec: it runs inside an all-reduce (DataParallel "
            "with AllReduce aggregation, or paratrain.comm.ddp_hook); ParameterServer, "
            "Decentralized and Federated exchanges cannot use it")

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


def build_codec(strategy: Any, *, stochastic_rounding: bool = True) -> Codec:
    """The codec tree for a CompressionStrategy (contract object, dict or JSON).

    Quantization rounds stochastically unless its ``rounding`` field says
    ``"deterministic"`` or ``stochastic_rounding=False`` turns it off for the whole tree."""
    s = load_compression(strategy)
    if isinstance(s, NoCompression):
        return NoneCodec()
    if isinstance(s, TopK):
        return TopKCodec(s.k)
    if isinstance(s, RandomK):
        return RandomKCodec(s.k)
    if isinstance(s, Threshold):
        return ThresholdCodec(s.threshold)
    if isinstance(s, Quantization):
        return QuantizationCodec(s.bits, stochastic=stochastic_rounding and s.rounding == "stochastic")
    if isinstance(s, ErrorFeedback | ClippedCompression):
        base = build_codec(s.base_strategy, stochastic_rounding=stochastic_rounding)
        if isinstance(s, ErrorFeedback):
            return ErrorFeedbackCodec(base, s.error_compensation)
        return ClippedCodec(base, s.clip_value)
    if isinstance(s, PowerSGD):
        return PowerSGDCodec(PowerSGDState.from_strategy(s))
    raise CompressionError(f"unknown compression strategy {s!r}")


def leaf_method(strategy: Any) -> str:
    """The method that ends up on the wire (wrappers removed), e.g. ``"TopK"``."""
    s = load_compression(strategy)
    while isinstance(s, ErrorFeedback | ClippedCompression):
        s = s.base_strategy
    return str(s.method)
