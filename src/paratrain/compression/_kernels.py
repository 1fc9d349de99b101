"""Which entries the sparse methods keep (TopK, Threshold, RandomK) and the cache-blocked
CPU kernels they share (same results as the plain torch path).

On a CPU the cost is memory traffic (every eager torch op reads and writes the whole tensor,
every temporary pays page faults), so these kernels walk the tensor in blocks of ``BLOCK``
elements (256 KiB of float32, in L2) with one reused scratch buffer and numpy ufuncs with
``out=``: each input byte is read once. Other devices and bfloat16 take the torch path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 1 << 16
# Tests switch this off to check that both paths give the same results.
USE_BLOCKED = True

_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}


def numpy_view(flat: torch.Tensor) -> np.ndarray | None:
    """A zero-copy numpy view of a contiguous 1-D CPU tensor, or None if unavailable."""
    if not USE_BLOCKED or flat.device.type != "cpu" or flat.dtype not in _NP_DTYPES or not flat.is_contiguous():
        return None
    if flat.requires_grad:
        flat = flat.detach()
    return flat.numpy()


def abs_above_indices(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Ascending int64 indices i with not(|x_i| <= threshold): |x_i| > t, and NaN entries.

    ``threshold`` is compared in the input's dtype (callers round it to that dtype
    first when the exact boundary matters).
    """
    xn = numpy_view(flat)
    if xn is None:
        return torch.nonzero(F.hardshrink(flat, threshold)).squeeze(1)
    return torch.from_numpy(abs_above_numpy(xn, threshold))


def abs_above_numpy(xn: np.ndarray, threshold: float) -> np.ndarray:
    """:func:`abs_above_indices` on a 1-D numpy array (int64 indices, ascending)."""
    n = xn.size
    t = xn.dtype.type(threshold)
    buf = np.empty(min(n, BLOCK), dtype=xn.dtype)
    mask = np.empty(min(n, BLOCK), dtype=np.bool_)
    parts = []
    for start in range(0, n, BLOCK):
        xc = xn[start : start + BLOCK]
        m = xc.size
        np.abs(xc, out=buf[:m])
        np.less_equal(buf[:m], t, out=mask[:m])
        np.logical_not(mask[:m], out=mask[:m])
        hit = np.flatnonzero(mask[:m])
        if hit.size:
            parts.append(hit + start)
    if not parts:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64, copy=False)


def scatter_dense(
    n: int, indices: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A flat zero tensor of length ``n`` with ``values`` placed at ``indices``."""
    out = torch.zeros(n, dtype=dtype, device=values.device)
    if indices.numel():
        out.index_copy_(0, indices.to(values.device), values.to(dtype))
    return out


def randomk_positions(n: int, k: int, seed: int) -> torch.Tensor:
    """Ascending int64 positions of the uniform k-subset of range(n) chosen by ``seed``."""
    k = min(max(k, 0), n)
    if k == n:
        return torch.arange(n)
    if k == 0:
        return torch.empty(0, dtype=torch.long)
    rng = np.random.Generator(np.random.PCG64(seed))
    idx = rng.choice(n, size=k, replace=False, shuffle=False).astype(np.int64, copy=False)
    idx.sort()
    return torch.from_numpy(idx)


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
    """Flat indices (ascending, int64) of the ``min(k, n)`` largest |flat| entries.

    Exact, but without a full ``torch.topk`` on large tensors, as in Deep Gradient
    Compression (Lin et al., ICLR 2018, §3 "sampling to reduce top-k selection time"):
    estimate the k-th magnitude from a random sample of |x|, keep every entry above the
    estimate in one cache-blocked pass (:func:`abs_above_indices`), then correct the count
    by an exact selection among those few candidates. The estimate is biased slightly low
    so that it almost always over-selects; if it still under-selects, the exact path runs.
    """
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


_INT_VIEW = {
    torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
}


def representable_floor(t: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` that is <= t (t >= 0).

    Kernels compare in the input's precision, so the threshold is first rounded *down*
    to it: no value of that dtype lies in (floor(t), t], hence |x| > floor(t) is exactly
    |x| > t for every x of that dtype.
    """
    if dtype not in _INT_VIEW:
        return t
    td = torch.tensor([t], dtype=torch.float64).to(dtype)
    if float(td) > t:
        td = (td.view(_INT_VIEW[dtype]) - 1).view(dtype)
    return float(td)


def threshold_indices(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Ascending int64 indices of the entries with |x| > threshold (and NaN entries)."""
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    return abs_above_indices(flat, representable_floor(threshold, flat.dtype))
