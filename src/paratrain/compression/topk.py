"""``{"method":"TopK","k":k}``: keep the ``min(k, n)`` entries of largest magnitude.

Per tensor, C(x)_i = x_i if i is among the k largest |x_i|, else 0, so
||x - C(x)||^2 <= (1 - k/n) ||x||^2 (the k largest squares are at least a k/n share of
the sum). Ties at the k-th magnitude are broken by the lower flat index (the Rust
reference's stable sort gives the same set); NaN counts as the largest magnitude, as in
``torch.topk``. Kept indices are returned in ascending order.

Selection is exact but avoids a full ``torch.topk`` on large tensors, as in Deep
Gradient Compression (Lin et al., ICLR 2018, §3 "sampling to reduce top-k selection
time"): estimate the k-th magnitude from a random sample of |x|, keep every entry above
the estimate in one cache-blocked pass (:func:`abs_above_indices`), then correct the count by
an exact selection among those few candidates. The estimate is biased slightly low so
that it almost always over-selects; if it still under-selects, the exact path runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ._kernels import abs_above_indices, abs_above_numpy, numpy_view
from .base import CompressedTensor, EncodeContext

__all__ = ["TopKCodec", "topk_indices"]

# Below this many elements a direct exact selection is as fast as sampling.
_FAST_MIN_NUMEL = 1 << 15
# Sample size for the magnitude estimate and the expected-rank floor it needs to be useful.
_SAMPLE = 1 << 14
_MIN_EXPECTED_RANK = 16


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    """|x| as float32 (or float64) with NaN mapped to +inf (largest magnitude)."""
    m = x.abs()
    if m.dtype in (torch.float16, torch.bfloat16):
        m = m.float()
    return torch.nan_to_num_(m, nan=math.inf, posinf=math.inf)


def _exact_among(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the k largest entries of ``mag``; ties -> lower position."""
    n = mag.numel()
    if k >= n:
        return torch.arange(n, device=mag.device)
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=mag.device)
    kth = torch.kthvalue(mag, n - k + 1).values
    sel = mag > kth
    need = k - int(sel.sum())
    if need > 0:
        eq = torch.nonzero(mag == kth).squeeze(1)[:need]
        sel[eq] = True
    return torch.nonzero(sel).squeeze(1)


def _np_magnitudes(v: np.ndarray) -> np.ndarray:
    m: np.ndarray = np.nan_to_num(np.abs(v), copy=False, nan=np.inf, posinf=np.inf)
    return m


def _np_exact_among(mag: np.ndarray, k: int) -> np.ndarray:
    """numpy twin of :func:`_exact_among` (``np.partition`` is an O(n) introselect)."""
    n = mag.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    kth = np.partition(mag, n - k)[n - k]
    sel = mag > kth
    need = k - int(np.count_nonzero(sel))
    if need > 0:
        sel[np.flatnonzero(mag == kth)[:need]] = True
    return np.flatnonzero(sel)


def _topk_numpy(xn: np.ndarray, k: int) -> np.ndarray:
    n = xn.size
    expected_rank = k * _SAMPLE / n
    if n >= _FAST_MIN_NUMEL and expected_rank >= _MIN_EXPECTED_RANK:
        pos = np.random.default_rng(n).integers(0, n, _SAMPLE)
        sample = _np_magnitudes(xn[pos])
        r = min(_SAMPLE, math.ceil(expected_rank + 4.0 * math.sqrt(expected_rank) + 2))
        thr = float(np.partition(sample, _SAMPLE - r)[_SAMPLE - r])
        if math.isfinite(thr) and thr > 0.0:
            cand = abs_above_numpy(xn, thr)
            if cand.size >= k:
                chosen: np.ndarray = cand[_np_exact_among(_np_magnitudes(xn[cand]), k)]
                return chosen
    return _np_exact_among(_np_magnitudes(xn), k)


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (ascending, int64) of the ``min(k, n)`` largest |flat| entries."""
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    xn = numpy_view(flat)
    if xn is not None:
        return torch.from_numpy(_topk_numpy(xn, k))
    expected_rank = k * _SAMPLE / n
    if n >= _FAST_MIN_NUMEL and expected_rank >= _MIN_EXPECTED_RANK:
        # A fixed generator: the sample only affects speed, never the result.
        g = torch.Generator(device="cpu")
        g.manual_seed(n)
        pos = torch.randint(n, (_SAMPLE,), generator=g).to(flat.device)
        sample = _magnitudes(flat[pos])
        # Rank with a 4-sigma margin (binomial) so the candidate set covers the top k.
        r = min(_SAMPLE, math.ceil(expected_rank + 4.0 * math.sqrt(expected_rank) + 2))
        thr = float(torch.kthvalue(sample, _SAMPLE - r + 1).values)
        if math.isfinite(thr) and thr > 0.0:
            # The candidates are exactly {|x| > thr}: an upper set of magnitudes, so when
            # it holds >= k entries it contains the top k with the same tie-breaking.
            cand = abs_above_indices(flat, thr)
            if cand.numel() >= k:
                return cand[_exact_among(_magnitudes(flat[cand]), k)]
    return _exact_among(_magnitudes(flat), k)


class TopKCodec:
    """Keep the k largest-magnitude entries of each tensor (k >= n keeps all)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"TopK.k must be >= 0, got {k}")
        self.k = k

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        idx = topk_indices(flat, self.k)
        return CompressedTensor("TopK", shape, flat.dtype, flat[idx], idx)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
