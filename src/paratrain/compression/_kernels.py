"""Cache-blocked CPU kernels shared by the methods (same results as the plain torch path).

On a CPU, the cost of compressing a large gradient is memory traffic: every eager torch
op reads and writes the whole tensor, and every fresh temporary pays page faults. These
kernels walk the tensor in blocks of ``BLOCK`` elements (256 KiB of float32, resident in
L2), reuse one small scratch buffer, and use numpy's ufuncs with ``out=`` so each input
byte is read from memory once. Tensors on other devices, or dtypes numpy lacks
(bfloat16), take the plain torch path.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "numpy_view", "abs_above_indices", "abs_above_numpy", "scatter_dense",
           "randomk_positions"]

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
