"""CompressionStrategy: the seven methods, tagged by ``"method"``, nested by ``base_strategy``.

The Rust enum has no serde form; this is ours in the same style as the strategy enums.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, field_validator

from ._base import Contract, Count, load_document, register_tags

__all__ = [
    "NoCompression", "TopK", "RandomK", "Threshold", "Quantization", "ErrorFeedback",
    "ClippedCompression", "CompressionStrategy", "load_compression", "dump_compression",
    "compression_schema",
]


class NoCompression(Contract):
    method: Literal["None"] = "None"


def _k_sends_something(k: int) -> int:
    if k == 0:
        raise ValueError("k = 0 keeps no entry, so nothing would be sent; use k >= 1 "
                         "(or method = \"None\" for no compression)")
    return k


class TopK(Contract):
    """Keep the ``k`` entries of largest magnitude per tensor (k >= n keeps all).

    ``k = 0`` is an error: it would keep no entry, so nothing would ever be sent.
    """

    method: Literal["TopK"] = "TopK"
    k: Count
    """Entries kept per tensor (>= 1; k >= the tensor's size keeps all)."""

    _sends_something = field_validator("k")(lambda k: _k_sends_something(k))


class RandomK(Contract):
    """Keep ``k`` positions drawn from a generator seeded by (seed, step, key).

    ``k = 0`` is an error, as for TopK: no position would ever be sent.
    """

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
    """Per-tensor min-max uniform quantization to ``bits`` (1..32), bit-packed.

    Extension ``rounding``: ``"stochastic"`` (the default: unbiased, E[D(C(x))] = x) or
    ``"deterministic"`` (round to nearest: biased, but error at most half a step).
    """

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


class ClippedCompression(Contract):
    """Clamp each value to [-clip_value, clip_value], then apply ``base_strategy``."""

    method: Literal["ClippedCompression"] = "ClippedCompression"
    base_strategy: CompressionStrategy
    """The compressor applied after clipping."""
    clip_value: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    """Each value is clamped to [-clip_value, clip_value] (> 0)."""


CompressionStrategy = Annotated[
    NoCompression | TopK | RandomK | Threshold | Quantization | ErrorFeedback | ClippedCompression,
    Field(discriminator="method"),
]

ErrorFeedback.model_rebuild()
ClippedCompression.model_rebuild()

register_tags(
    ["None", "TopK", "RandomK", "Threshold", "Quantization", "ErrorFeedback", "ClippedCompression"]
)

_ADAPTER: TypeAdapter[Any] = TypeAdapter(CompressionStrategy)


def load_compression(doc: str | bytes | dict[str, Any] | Contract) -> Any:
    """Validate a CompressionStrategy from JSON text or a dict; raises ConfigError."""
    if isinstance(doc, Contract):
        return doc
    return load_document(_ADAPTER.validate_python, doc)


def dump_compression(strategy: Any) -> dict[str, Any]:
    out: dict[str, Any] = _ADAPTER.dump_python(strategy, mode="json")
    return out


def compression_schema() -> dict[str, Any]:
    schema: dict[str, Any] = _ADAPTER.json_schema()
    return schema
