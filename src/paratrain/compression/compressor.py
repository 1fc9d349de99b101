"""The :class:`Compressor`: a CompressionStrategy's codec tree (:func:`build_codec`) plus
per-key state. Keys name tensors stably (parameter names): residuals and
RandomK/stochastic-rounding seeds are per key, and RandomK positions depend only on
(seed, step, key), so every rank draws the same ones. Statistics follow the Rust
``CompressionStats`` (:class:`CompressionStats`): original bytes count the input at its own
dtype, compressed bytes the exact wire size (header included).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..config.compression import dump_compression, load_compression
from .base import Codec, CompressedTensor, EncodeContext, check_input, decompress
from .codecs import ErrorFeedbackCodec, PowerSGDCodec, build_codec, leaf_method
from .powersgd import PowerSGDState
from .wire import CompressionError

STATE_VERSION = 1


@dataclass
class CompressionStats:
    """Byte counts of the compressions recorded so far (byte-weighted), best/worst per call."""

    count: int = 0
    original_bytes: int = 0
    compressed_bytes: int = 0
    best_ratio: float = math.inf
    worst_ratio: float = 0.0

    def record(self, original: int, compressed: int) -> None:
        self.count += 1
        self.original_bytes += original
        self.compressed_bytes += compressed
        r = compressed / original if original else 1.0
        self.best_ratio = min(self.best_ratio, r)
        self.worst_ratio = max(self.worst_ratio, r)

    @property
    def ratio(self) -> float:
        """compressed / original bytes (1.0 when nothing was recorded)."""
        return self.compressed_bytes / self.original_bytes if self.original_bytes else 1.0

    @property
    def savings(self) -> float:
        """Bandwidth saved, in percent: 100 (1 - ratio)."""
        return 100.0 * (1.0 - self.ratio)

    def as_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = asdict(self)
        d["ratio"] = self.ratio
        d["savings"] = self.savings
        return d


class Compressor:
    """Compress named tensors with one CompressionStrategy, keeping per-key state.

    >>> comp = Compressor({"method": "ErrorFeedback", "error_compensation": True,
    ...                    "base_strategy": {"method": "TopK", "k": 10}}, seed=0)
    >>> g_hat = comp.roundtrip("fc0.weight", torch.randn(64, 64))  # D(C(g + e))
    >>> comp.step()  # advance the step that seeds RandomK / stochastic rounding
    1
    """

    def __init__(
        self, strategy: Any = None, *, seed: int = 0, stochastic_rounding: bool = True
    ) -> None:
        self.strategy = load_compression(strategy if strategy is not None else {"method": "None"})
        self.seed = int(seed)
        self.stochastic_rounding = stochastic_rounding
        self.codec: Codec = build_codec(self.strategy, stochastic_rounding=stochastic_rounding)
        self.method = leaf_method(self.strategy)
        self.powersgd: PowerSGDState | None = None
        if isinstance(self.codec, PowerSGDCodec):
            self.powersgd = self.codec.state
            self.powersgd.reseed(self.seed)
        self._step = 0
        self.stats = CompressionStats()
        self.key_stats: dict[str, CompressionStats] = {}

    @property
    def current_step(self) -> int:
        return self._step

    def step(self) -> int:
        """Advance the step counter (once per training step) and return the new value."""
        self._step += 1
        if self.powersgd is not None:
            self.powersgd.advance()
        return self._step

    def compress(self, key: str, tensor: torch.Tensor, *, step: int | None = None) -> CompressedTensor:
        """C(tensor) for the tensor named ``key`` at ``step`` (default: the counter)."""
        flat = check_input(tensor)
        ctx = EncodeContext(str(key), self._step if step is None else int(step), self.seed)
        c = self.codec.encode(flat, tuple(tensor.shape), ctx)
        original, compressed = c.original_nbytes, c.nbytes
        self.stats.record(original, compressed)
        self.key_stats.setdefault(ctx.key, CompressionStats()).record(original, compressed)
        return c

    def decompress(self, c: CompressedTensor) -> torch.Tensor:
        """D(c), shaped like the original tensor."""
        cached = c._cache.pop("dense", None)
        return cached if cached is not None else decompress(c)

    def roundtrip(self, key: str, tensor: torch.Tensor, *, step: int | None = None) -> torch.Tensor:
        """D(C(tensor)): what the receiver reconstructs; updates error-feedback state."""
        return self.decompress(self.compress(key, tensor, step=step))

    def residual(self, key: str) -> torch.Tensor | None:
        """The outermost error-feedback residual for ``key`` (flat; ``None`` before its first
        compression): the live buffer, updated in place by the next compression of ``key``."""
        codec: Any = self.codec
        while codec is not None:
            if isinstance(codec, ErrorFeedbackCodec):
                return codec.residuals.get(key)
            codec = getattr(codec, "base", None)
        return None

    def reset_stats(self) -> None:
        self.stats = CompressionStats()
        self.key_stats = {}

    def stats_dict(self) -> dict[str, Any]:
        """Totals plus ``per_key`` (JSON-ready, for metrics.jsonl)."""
        out: dict[str, Any] = self.stats.as_dict()
        out["per_key"] = {k: v.as_dict() for k, v in self.key_stats.items()}
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: step, seed, residuals, statistics (plain
        types only: loadable with ``torch.load(weights_only=True)``)."""
        return {
            "version": STATE_VERSION,
            "strategy": dump_compression(self.strategy),
            "seed": self.seed,
            "step": self._step,
            "codec": self.codec.state_dict(),
            "stats": {
                "total": asdict(self.stats),
                "per_key": {k: asdict(v) for k, v in self.key_stats.items()},
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the strategy must match."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise CompressionError(
                f"unsupported compressor state (version {state.get('version') if isinstance(state, dict) else None!r})"
            )
        theirs = state.get("strategy")
        if theirs is not None and theirs != dump_compression(self.strategy):
            raise CompressionError(
                f"compressor state was saved for strategy {theirs}, this compressor uses "
                f"{dump_compression(self.strategy)}"
            )
        self.seed = int(state.get("seed", self.seed))
        self._step = int(state.get("step", 0))
        self.codec.load_state_dict(state.get("codec", {}))
        stats = state.get("stats", {})
        self.stats = CompressionStats(**stats.get("total", {}))
        self.key_stats = {k: CompressionStats(**v) for k, v in stats.get("per_key", {}).items()}
