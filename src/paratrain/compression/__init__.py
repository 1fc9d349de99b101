"""Gradient compression: pure tensor maths, a compact wire format, per-key state.

The methods (DESIGN §4) are the codecs of :mod:`.codecs` and ``PowerSGD`` (:mod:`.powersgd`,
driven inside an all-reduce). Inputs: float32, float16, bfloat16 and float64 tensors of any
shape (empty included), on any device. RandomK positions and stochastic-rounding noise derive
from (seed, step, key) only, so every rank with the same seed draws the same ones and a
resumed run repeats the draws of the original.

Usage::

    comp = Compressor({"method": "TopK", "k": 100}, seed=0)
    c = comp.compress("fc0.weight", grad)           # the leaf method's CompressedTensor
    c2 = CompressedTensor.from_bytes(c.to_bytes())  # strict: CompressionError on bad bytes
    grad.copy_(comp.decompress(c2))                 # D(c); comp.roundtrip(key, t) does both
    comp.step()                                     # new RandomK positions / rounding noise
    comp.load_state_dict(comp.state_dict())         # residuals, step, seed, stats: exact resume

The DDP comm hook and ``allreduce_compressed`` live in ``paratrain.comm.ddp_hook`` (the
only package that calls torch.distributed); this package never calls torch.distributed
and does no I/O.
"""

from __future__ import annotations

from ._kernels import randomk_positions, topk_indices
from .base import CompressedTensor, EncodeContext, decompress, derive_seed, from_bytes
from .codecs import build_codec, leaf_method
from .compressor import CompressionStats, Compressor
from .powersgd import PowerSGDState
from .quant_kernels import pack_codes, packed_nbytes, unpack_codes
from .wire import CompressionError, information_minimum, to_bytes, wire_nbytes

__all__ = [
    "Compressor", "CompressedTensor", "CompressionError", "CompressionStats", "PowerSGDState",
    "EncodeContext", "build_codec", "decompress", "derive_seed", "leaf_method", "from_bytes",
    "to_bytes", "wire_nbytes", "information_minimum", "pack_codes", "unpack_codes",
    "packed_nbytes", "randomk_positions", "topk_indices",
]
