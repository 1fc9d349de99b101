"""``{"method":"PowerSGD","rank":r,"start_step":s}``: low-rank, all-reduce compatible compression.

PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1) views each
gradient as a matrix ``M`` (``n`` = its first dimension, ``m`` = the product of the rest)
and replaces it by a rank-``r'`` approximation, ``r' = min(n, m, r)``, found by one step of
subspace (power) iteration per training step::

    M_w   = G_w + e_w                     rank w's gradient plus its error (feedback)
    P     = sum_w M_w Q                   Q: (m, r'), orthonormal columns   [all-reduce 1]
    P_hat = orthogonalize(P)              Gram-Schmidt (r' <= 2) or QR, on every rank alike
    Q     = (1/W) sum_w M_w^T P_hat                                         [all-reduce 2]
    out   = P_hat Q^T                     = P_hat P_hat^T mean_w(M_w), identical on every rank
    e_w   = M_w - out                     error feedback (Karimireddy et al. 2019)

Both collectives are **sums of same-shaped tensors**, so PowerSGD runs over all-reduce:
``r'(n + m)`` values per matrix instead of ``n m``, only where that saves a factor
``min_compression_rate`` (:func:`should_compress`); 1-D tensors and the rest are averaged
exactly, in the same first all-reduce as ``P``. Warm start keeps this step's ``Q`` as the
next step's starting point; otherwise a fresh random ``Q`` is drawn every step.

The maths mirrors ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` operation
for operation (same ``bmm`` products, orthogonalisation and epsilon, random ``Q`` from
``numpy.random.RandomState(seed).randint(1e9)`` -> ``torch.manual_seed`` -> ``randn`` in
shape-grouped order), so a compressed matrix's result equals torch's bit for bit. State is
keyed by **tensor name**, not by DDP bucket index (resumable, immune to bucket rebuilds),
and uncompressed tensors keep no residual (docs/compression.md says why). Pure tensor
maths: :class:`PowerSGDRound` hands the transport the two buffers to all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .wire import CompressionError


def orthogonalize_gram_schmidt(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """In place: the columns of each ``(b, n, k)`` matrix become orthonormal (classical
    Gram-Schmidt, column by column, as torch's ``_orthogonalize_gram_schmidt``).

    ``epsilon > 0`` divides by ``norm + epsilon``. With ``epsilon = 0`` a column of zeros
    stays zero (torch intends this; its tensor division yields NaN instead)."""
    num_cols = matrices.shape[2]
    for i in range(num_cols):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        if epsilon == 0:
            # A zero column has norm 0: divide it by 1 instead (it stays 0; torch gets 0/0 =
            # NaN, its dead except-branch meant 0). Any other column divides as in torch.
            col /= norm.masked_fill_(norm == 0, 1.0)
        else:
            col /= norm + epsilon
        if i + 1 < num_cols:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """In place, batched ``(b, n, k)`` with ``k <= n``: Gram-Schmidt for ``k <= 2`` or half
    precision, Householder QR (``torch.linalg.qr``) otherwise: torch's ``_orthogonalize``.
    Either basis spans the same subspace, and PowerSGD's output depends only on the span."""
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise CompressionError(f"orthogonalize: expected (b, n, k) with k <= n, got {tuple(matrices.shape)}")
    b, _, k = matrices.shape
    if k <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        orthogonalize_gram_schmidt(matrices, epsilon)
    else:
        r = torch.empty(b, k, k, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(n, m)``: the tensor as torch's hook views it (``t.view(t.shape[0], -1)``);
    ``None`` for 0-d and 1-d tensors (never compressed)."""
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """torch's ``_should_compress``: ``r'(n + m) * rate < n m`` with ``r' = min(n, m, rank)``."""
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


def wire_numel(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float = 2.0) -> int:
    """Values one rank sends per PowerSGD step: ``r'(n + m)`` per compressed matrix plus
    every other tensor's ``numel`` (times the dtype's size for bytes)."""
    total = 0
    for shape in shapes:
        nm = matrix_shape(shape)
        if nm is not None and should_compress(*nm, rank, min_compression_rate):
            total += min(nm[0], nm[1], rank) * (nm[0] + nm[1])
        else:
            total += math.prod(int(d) for d in shape)
    return total


class PowerSGDRound:
    """One PowerSGD exchange of named gradients (built by :meth:`PowerSGDState.begin`).

    The transport does: ``first`` all-reduce (SUM) -> :meth:`second` -> all-reduce (SUM)
    of the tensor it returns -> :meth:`finish` ``(world)``, which returns each gradient's
    mean approximation in input order and updates the state (residuals, warm Q).
    ``first`` is ``[uncompressed values | P]``; ``second()`` is ``Q``."""

    def __init__(self, state: PowerSGDState, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.state = state
        self.named = [(k, t.detach()) for k, t in named]
        dtypes = {t.dtype for _, t in self.named}
        if len(dtypes) > 1:
            raise CompressionError(f"PowerSGD: one exchange needs one dtype, got {sorted(map(str, dtypes))}")
        dtype = self.named[0][1].dtype if self.named else torch.float32
        device = self.named[0][1].device if self.named else torch.device("cpu")
        rank, rate = state.rank, state.min_compression_rate
        # Group the compressed matrices by shape, first appearance first (torch's order:
        # it decides where P and Q sit in the flat buffers and which random Q each gets).
        groups: dict[tuple[int, int], list[int]] = {}
        self.plain: list[int] = []
        for i, (_, t) in enumerate(self.named):
            nm = matrix_shape(t.shape)
            if nm is not None and should_compress(*nm, rank, rate):
                groups.setdefault(nm, []).append(i)
            else:
                self.plain.append(i)
        self.order = [i for members in groups.values() for i in members]
        self.n_plain = n_plain = sum(self.named[i][1].numel() for i in self.plain)
        shapes = [shape for shape, members in groups.items() for _ in members]  # in self.order
        sizes = [(n, m, min(n, m, rank)) for n, m in shapes]
        p_total = sum(n * r for n, _, r in sizes)
        q_total = sum(m * r for _, m, r in sizes)
        self.first = torch.empty(n_plain + p_total, dtype=dtype, device=device)
        self.q_flat = torch.empty(q_total, dtype=dtype, device=device)
        off = 0
        for i in self.plain:
            t = self.named[i][1]
            self.first[off : off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        self.ms: list[torch.Tensor] = []
        self.ps: list[torch.Tensor] = []
        self.qs: list[torch.Tensor] = []
        q_off = 0
        for i, (n, m, r) in zip(self.order, sizes, strict=True):
            key, t = self.named[i]
            g = t.reshape(1, n, m)
            e = state.residuals.get(key) if state.error_feedback else None
            if e is not None:
                if e.shape != g.shape or e.dtype != g.dtype:
                    raise CompressionError(
                        f"PowerSGD residual for {key!r} is {tuple(e.shape)} {e.dtype}; the "
                        f"gradient is {tuple(g.shape)} {g.dtype} (a key must name one tensor)")
                mat = g + e.to(g.device)
            else:
                mat = g.clone()
            self.ms.append(mat)
            self.ps.append(self.first[off : off + n * r].view(1, n, r))
            self.qs.append(self.q_flat[q_off : q_off + m * r].view(1, m, r))
            off += n * r
            q_off += m * r
        keys = [self.named[i][0] for i in self.order]
        fresh = [not state.warm_start or k not in state.q_memory for k in keys]
        gen = state._draw_generator() if any(fresh) else None
        for key, q, new in zip(keys, self.qs, fresh, strict=True):
            if new:
                assert gen is not None
                q.copy_(torch.randn(*q.shape, generator=gen, device="cpu", dtype=dtype))
            else:
                q.copy_(state.q_memory[key])
            orthogonalize(q, state.epsilon)
        for mat, q, p in zip(self.ms, self.qs, self.ps, strict=True):
            torch.bmm(mat, q, out=p)

    def second(self) -> torch.Tensor:
        """After ``first`` was summed over ranks: orthogonalise each P, compute Q = M^T P_hat."""
        for p in self.ps:
            orthogonalize(p, self.state.epsilon)
        for mat, p, q in zip(self.ms, self.ps, self.qs, strict=True):
            torch.bmm(mat.transpose(1, 2), p, out=q)
        return self.q_flat

    def finish(self, world: int, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """After ``second()`` was summed over ranks: the means, in input order (shapes and
        dtype of the inputs), written into ``out`` when given (e.g. a DDP bucket's
        gradient views, as torch's hook does); updates residuals and warm-start Q."""
        state = self.state
        self.q_flat.div_(world)
        res: list[torch.Tensor | None] = [None] * len(self.named)
        plain = self.first[: self.n_plain].div_(world)
        off = 0
        for i in self.plain:
            t = self.named[i][1]
            mean = plain[off : off + t.numel()].view(t.shape)
            res[i] = mean if out is None else out[i].copy_(mean)
            off += t.numel()
        for i, mat, p, q in zip(self.order, self.ms, self.ps, self.qs, strict=True):
            key, t = self.named[i]
            if out is None:
                approx = torch.bmm(p, q.transpose(1, 2))
            else:
                approx = torch.bmm(p, q.transpose(1, 2), out=out[i].view(mat.shape))
            if state.error_feedback:
                state.residuals[key] = mat.sub_(approx)
            if state.warm_start:
                state.q_memory[key] = q
            res[i] = approx.view(t.shape)
        if not state.warm_start:
            state.q_memory.clear()
        return [o for o in res if o is not None]


class PowerSGDState:
    """PowerSGD's configuration and per-name state (residual ``e``, warm ``Q``), the step
    counter, and the seed stream for fresh ``Q`` (torch's ``PowerSGDState`` by name).

    ``step`` counts exchanges (training steps); steps ``< start_step`` are plain all-reduces
    (:meth:`active` is False) and leave the state alone. :meth:`state_dict` holds only
    tensors, ints, floats and bools, so a run resumed from it continues bit for bit.
    """

    def __init__(
        self, rank: int, *, start_step: int = 0, min_compression_rate: float = 2.0,
        warm_start: bool = True, error_feedback: bool = True, epsilon: float = 0.0, seed: int = 0,
    ) -> None:
        if rank < 1:
            raise CompressionError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = int(rank)
        self.start_step = int(start_step)
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self.epsilon = float(epsilon)
        self.step = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self.q_memory: dict[str, torch.Tensor] = {}
        self.reseed(seed)

    @classmethod
    def from_strategy(cls, strategy: Any, *, seed: int = 0) -> PowerSGDState:
        """From a validated ``PowerSGD`` contract object."""
        return cls(strategy.rank, start_step=strategy.start_step,
                   min_compression_rate=strategy.min_compression_rate,
                   warm_start=strategy.warm_start, error_feedback=strategy.error_feedback,
                   epsilon=strategy.orthogonalization_epsilon, seed=seed)

    def reseed(self, seed: int) -> None:
        """Restart the stream of seeds for fresh Q at ``seed`` (torch's ``random_seed``)."""
        self.seed = int(seed)
        self.draws = 0
        self._rng = np.random.RandomState(self.seed)

    def active(self) -> bool:
        """Whether this step compresses (``step >= start_step``)."""
        return self.step >= self.start_step

    def advance(self) -> int:
        self.step += 1
        return self.step

    def _draw_generator(self) -> torch.Generator:
        # torch: torch.manual_seed(state.rng.randint(1_000_000_000)) per bucket that needs Q.
        self.draws += 1
        g = torch.Generator(device="cpu")
        g.manual_seed(int(self._rng.randint(1_000_000_000)))
        return g

    def begin(self, named: Sequence[tuple[str, torch.Tensor]]) -> PowerSGDRound:
        """Start a compressed exchange of ``named`` gradients (same order on every rank)."""
        return PowerSGDRound(self, named)

    def wire_numel(self, shapes: Sequence[Sequence[int]]) -> int:
        """:func:`wire_numel` at this state's rank and rate (before ``start_step``: all values)."""
        if not self.active():
            return sum(int(np.prod(s)) for s in shapes)
        return wire_numel(shapes, self.rank, self.min_compression_rate)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "seed": self.seed, "draws": self.draws, "rank": self.rank,
            "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
            "q": {k: v.detach().clone() for k, v in self.q_memory.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or int(state.get("rank", self.rank)) != self.rank:
            raise CompressionError(
                f"PowerSGD state was saved at rank {state.get('rank') if isinstance(state, dict) else None!r}, "
                f"this run uses rank {self.rank}")
        for field in ("residuals", "q"):
            d = state.get(field, {})
            if not isinstance(d, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items()):
                raise CompressionError(f"PowerSGD state: {field!r} must map str -> Tensor")
        self.step = int(state.get("step", 0))
        self.seed = int(state.get("seed", self.seed))
        self.residuals = {k: v.detach().clone() for k, v in state.get("residuals", {}).items()}
        self.q_memory = {k: v.detach().clone() for k, v in state.get("q", {}).items()}
        # Replay the seed stream (one randint per fresh-Q exchange) to where it was.
        self.reseed(self.seed)
        self.draws = int(state.get("draws", 0))
        for _ in range(self.draws):
            self._rng.randint(1_000_000_000)
