"""The compressed-tensor record, the codec protocol and the helpers every method shares.

A :class:`CompressedTensor` is what one *leaf* method produced for one tensor; wrappers never
appear in it (like the Rust ``CompressionMetadata.strategy``), so any process can decode any
record without knowing the wrapper stack.

Layout of the fields per method (``n = prod(shape)``):

======================  ============================================  ===============
method                  ``values``                                    ``indices``
======================  ============================================  ===============
``None``                all ``n`` values at ``dtype``                 ``None``
``TopK``/``Threshold``  kept values at ``dtype``, ascending index     int64 ascending
``RandomK``             ``k`` values at ``dtype``, ascending index    re-derived from ``seed``
``Quantization``        ``ceil(n*bits/8)`` uint8 bit-packed codes     ``None``
======================  ============================================  ===============
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ._kernels import scatter_dense
from .quant_kernels import dequantize_packed
from .wire import SUPPORTED_DTYPES, parse, to_bytes, wire_nbytes
from .wire import CompressionError as CompressionError  # re-exported: executors.federated.wire


def derive_seed(seed: int, step: int, key: str, salt: str = "") -> int:
    """A 63-bit seed from (seed, step, key), identical on every rank and platform: blake2b,
    not Python's per-process salted ``hash``, so ranks that never talk draw alike."""
    h = hashlib.blake2b(f"{salt}|{seed}|{step}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def check_input(tensor: Any) -> torch.Tensor:
    """Validate a tensor for compression and return it flattened (a view when possible)."""
    if not isinstance(tensor, torch.Tensor):
        raise CompressionError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise CompressionError(
            f"unsupported dtype {tensor.dtype}; supported: "
            + ", ".join(str(d) for d in SUPPORTED_DTYPES)
        )
    if tensor.is_sparse:
        raise CompressionError("sparse tensors are not supported; pass a dense tensor")
    return tensor.detach().reshape(-1)


def decompress(c: Any) -> torch.Tensor:
    """D(c): the dense tensor of ``c.shape`` and ``c.dtype`` by the record's (leaf) method
    (may share memory with ``c``). Reads only the record's fields, so the same function
    decodes what any rank's codec stack produced (DESIGN §3)."""
    n = c.numel
    if c.method == "None":
        if c.values.numel() != n:
            raise CompressionError(f"None record holds {c.values.numel()} values, expected {n}")
        dense: torch.Tensor = c.values.to(c.dtype).reshape(c.shape)
        return dense
    if c.method in ("TopK", "Threshold", "RandomK"):
        if c.indices is None or c.indices.numel() != c.values.numel():
            raise CompressionError(f"{c.method} record needs one index per value")
        return scatter_dense(n, c.indices, c.values, c.dtype).reshape(c.shape)
    if c.method == "Quantization":
        return dequantize_packed(c.values, n, c.offset, c.scale, c.bits, c.dtype).reshape(c.shape)
    raise CompressionError(f"unknown method {c.method!r}")


@dataclass(frozen=True, eq=False)
class CompressedTensor:
    """One tensor after a leaf method (module docstring): ``bits``, ``offset`` (the minimum)
    and ``scale`` are Quantization's, ``seed`` and ``k`` RandomK's; ``stochastic`` records the
    rounding mode (not needed to decode)."""

    method: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None
    bits: int = 0
    offset: float = 0.0
    scale: float = 0.0
    seed: int = 0
    k: int = 0
    stochastic: bool = False
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Number of values carried (all ``n`` for the dense methods)."""
        if self.method == "Quantization":
            return self.numel
        return int(self.values.numel())

    @property
    def original_nbytes(self) -> int:
        """Bytes of the uncompressed tensor at its own dtype."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Exact length of :meth:`to_bytes` (computed without serialising)."""
        return wire_nbytes(self)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to_bytes(self) -> bytes:
        """Serialise to the versioned wire format (see :mod:`paratrain.compression.wire`)."""
        return to_bytes(self)

    @staticmethod
    def from_bytes(
        data: bytes | bytearray | memoryview,
        *,
        max_numel: int | None = None,
        expect_shape: tuple[int, ...] | None = None,
        expect_dtype: torch.dtype | None = None,
    ) -> CompressedTensor:
        """Parse and validate a wire payload (:func:`paratrain.compression.wire.parse`);
        raises :class:`CompressionError`."""
        return CompressedTensor(**parse(data, max_numel=max_numel, expect_shape=expect_shape,
                                        expect_dtype=expect_dtype))

    def decompress(self) -> torch.Tensor:
        """The dense tensor ``D(c)`` of ``shape`` and ``dtype`` on ``values.device``."""
        return decompress(self)


@dataclass(slots=True)
class EncodeContext:
    """The key, step and base seed of a call: every random draw is seeded by
    ``derived_seed(salt)``, so an exact resume needs no RNG state."""

    key: str
    step: int
    seed: int

    def derived_seed(self, salt: str) -> int:
        return derive_seed(self.seed, self.step, self.key, salt)


class Codec(Protocol):
    """A leaf method or a wrapper around another codec: ``encode`` returns the record of the
    leaf that encoded the (possibly transformed) input; stateless codecs' state is ``{}``."""

    def encode(self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext) -> CompressedTensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# the module-level name paratrain.compression.from_bytes
from_bytes = CompressedTensor.from_bytes
