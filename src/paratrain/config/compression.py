"""CompressionStrategy: the methods, tagged by ``"method"``, nested by ``base_strategy`` (the
Rust enum has no serde form; this is ours in the same style as the strategy enums)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from ._base import Codec, Contract, Count


class NoCompression(Contract):
    method: Literal["None"] = "None"


def _k_sends_something(k: int) -> int:
    if k == 0:
        raise ValueError("k = 0 keeps no entry, so nothing would be sent; use k >= 1 "
                         "(or method = \"None\" for no compression)")
    return k


class TopK(Contract):
    """Keep the ``k`` entries of largest magnitude per tensor (k >= n keeps all)."""

    method: Literal["TopK"] = "TopK"
    k: Count
    """Entries kept per tensor (>= 1; k >= the tensor's size keeps all)."""

    _sends_something = field_validator("k")(lambda k: _k_sends_something(k))


class RandomK(Contract):
    """Keep ``k`` positions drawn from a generator seeded by (seed, step, key)."""

    method: Literal["RandomK"] = "RandomK"
    k: Count
    """Positions kept per tensor (>= 1), drawn from a generator seeded by (seed, step, key)."""

    _sends_something = field_validator("k")(lambda k: _k_sends_something(k))


class Threshold(Contract):
    """Keep entries with ``|v| > threshold`` (strict)."""

    method: Literal["Threshold"] = "Threshold"
    threshold: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    """Keep the entries whose magnitude is strictly greater (>= 0)."""


class Quantization(Contract):
    """Per-tensor min-max uniform quantization to ``bits`` (1..32), bit-packed."""

    method: Literal["Quantization"] = "Quantization"
    bits: Annotated[int, Field(ge=1, le=32, strict=True)]
    """Bits per value, 1..32."""
    rounding: Literal["stochastic", "deterministic"] = "stochastic"
    """Extension: ``stochastic`` (unbiased, the default) or ``deterministic`` (round to nearest:
    biased, error at most half a step)."""
    _extensions: ClassVar[frozenset[str]] = frozenset({"rounding"})


class ErrorFeedback(Contract):
    """Residual per key: p = g + e; c = C(p); e <- p - D(c)."""

    method: Literal["ErrorFeedback"] = "ErrorFeedback"
    base_strategy: CompressionStrategy
    """The compressor whose error is fed back."""
    error_compensation: bool
    """Keep the residual e and add it to the next input (false = the base compressor alone)."""
    _not_powersgd = field_validator("base_strategy")(lambda b: _no_powersgd_inside(b))


class ClippedCompression(Contract):
    """Clamp each value to [-clip_value, clip_value], then apply ``base_strategy``."""

    method: Literal["ClippedCompression"] = "ClippedCompression"
    base_strategy: CompressionStrategy
    """The compressor applied after clipping."""
    _not_powersgd = field_validator("base_strategy")(lambda b: _no_powersgd_inside(b))
    clip_value: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    """Each value is clamped to [-clip_value, clip_value] (> 0)."""


class PowerSGD(Contract):
    """Extension: rank-``rank`` PowerSGD (Vogels et al., NeurIPS 2019), all-reduce compatible.

    Each gradient viewed as a matrix M (n = dim 0, m = the rest) is approximated by
    P Q^T with P = M Q and Q = M^T P_hat, both all-reduced; error feedback and warm-started
    Q are built in, so it cannot be wrapped by ErrorFeedback/ClippedCompression. Steps
    before ``start_step`` are a plain all-reduce (torch's ``start_powerSGD_iter``).
    """

    method: Literal["PowerSGD"] = "PowerSGD"
    rank: Annotated[int, Field(ge=1, strict=True)]
    """Rank r of the approximation (>= 1; min(n, m, r) per matrix)."""
    start_step: Count = 0
    """Steps 0..start_step-1 run a plain all-reduce; PowerSGD from ``start_step`` on."""
    min_compression_rate: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 2.0
    """Compress a matrix only if n*m > min_compression_rate * r*(n+m) (torch's rule;
    1-D tensors are never compressed)."""
    warm_start: bool = True
    """Reuse last step's Q (one power iteration per step) instead of a fresh random Q."""
    error_feedback: bool = True
    """Feed each rank's approximation error into its next step's gradient."""
    orthogonalization_epsilon: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    """Added to each column norm in Gram-Schmidt (guards all-zero columns), as torch."""
    _extensions: ClassVar[frozenset[str]] = frozenset(
        {"start_step", "min_compression_rate", "warm_start", "error_feedback",
         "orthogonalization_epsilon"})


def _no_powersgd_inside(base: Any) -> Any:
    if getattr(base, "method", None) == "PowerSGD":
        raise ValueError("PowerSGD cannot be wrapped: it keeps its own error feedback and "
                         "runs its own all-reduces; use it as the top-level [compression]")
    return base


CompressionStrategy = Annotated[
    NoCompression | TopK | RandomK | Threshold | Quantization | ErrorFeedback | ClippedCompression
    | PowerSGD,
    Field(discriminator="method"),
]

ErrorFeedback.model_rebuild()
ClippedCompression.model_rebuild()

_CODEC = Codec(CompressionStrategy)
load_compression = _CODEC.load  # a CompressionStrategy from JSON text or a dict
dump_compression = _CODEC.dump
compression_schema = _CODEC.schema
