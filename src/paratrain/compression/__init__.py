"""Gradient compression: pure tensor maths, a compact wire format, per-key state.

Methods (one module each; DESIGN §4): ``None`` (:mod:`.none`), ``TopK`` (:mod:`.topk`),
``RandomK`` (:mod:`.randomk`), ``Threshold`` (:mod:`.threshold`), ``Quantization``
(:mod:`.quantization`), and the wrappers ``ErrorFeedback`` (:mod:`.error_feedback`) and
``ClippedCompression`` (:mod:`.clipped`), composable to any depth, e.g.
``ErrorFeedback(ClippedCompression(TopK))``. ``PowerSGD`` (:mod:`.powersgd`, Vogels et
al. 2019) is not a per-tensor codec: its two all-reduces (P, then Q) sit inside the
compression, so ``paratrain.comm.powersgd`` drives its :class:`PowerSGDState`
(``Compressor.powersgd``) and ``Compressor.compress`` refuses it. Inputs: float32, float16, bfloat16 and
float64 tensors of any shape (empty included), on any device.

Usage::

    from paratrain.compression import Compressor, CompressedTensor

    comp = Compressor({"method": "ErrorFeedback", "error_compensation": True,
                       "base_strategy": {"method": "TopK", "k": 100}}, seed=0)
    for step, batch in enumerate(loader):
        ...
        for name, p in model.named_parameters():
            c = comp.compress(name, p.grad)          # CompressedTensor (leaf method's record)
            wire = c.to_bytes()                      # versioned, compact bytes
            c2 = CompressedTensor.from_bytes(wire)   # strict: CompressionError on bad input
            p.grad.copy_(comp.decompress(c2))        # D(c), same shape and dtype
            # or simply: p.grad.copy_(comp.roundtrip(name, p.grad))
        comp.step()                                  # new RandomK positions / rounding noise
    ckpt["compressor"] = comp.state_dict()           # residuals, step, seed, stats
    comp.load_state_dict(ckpt["compressor"])         # continue exactly
    comp.stats.ratio, comp.stats.savings, comp.key_stats["fc0.weight"].compressed_bytes

Semantics in brief (algebra in each module):

* ``compress(key, tensor, step=None)``: ``step`` defaults to the counter that ``step()``
  advances. RandomK positions and stochastic-rounding noise derive from
  (seed, step, key) only, so every rank with the same seed draws the same positions and
  a resumed run repeats the draws of the original.
* Error feedback: p = g + e; c = C(p); e <- p - D(c), one residual per key.
* ``CompressedTensor`` fields: ``method, shape, dtype, values, indices`` (+ ``bits,
  offset, scale`` for Quantization, ``seed, k`` for RandomK); ``nbytes`` is the exact
  wire size, ``original_nbytes`` the input's size at its dtype.
* ``CompressedTensor.from_bytes(b, max_numel=..., expect_shape=..., expect_dtype=...)``
  validates every field and raises :class:`CompressionError` (a ``ValueError``) on any
  malformed, truncated or hostile payload.
* ``paratrain.comm.ddp_hook.ddp_hook(strategy, model=..., seed=0)`` returns ``(state,
  hook)`` for ``DistributedDataParallel.register_comm_hook``; it lives in ``comm/`` (the
  only place that calls torch.distributed), which depends on this package, not the other
  way round. ``allreduce_compressed`` there averages named tensors across ranks with a
  Compressor (for executors that manage their own gradients).

This package never calls torch.distributed and does no I/O.
"""

from __future__ import annotations

from ._kernels import randomk_positions
from .base import CompressedTensor, EncodeContext, derive_seed, from_bytes
from .compressor import CompressionStats, Compressor, build_codec, leaf_method
from .decode import decompress
from .errors import CompressionError
from .powersgd import PowerSGDState
from .quant_kernels import pack_codes, packed_nbytes, unpack_codes
from .topk import topk_indices
from .wire import information_minimum, to_bytes, wire_nbytes

__all__ = [
    "Compressor",
    "CompressedTensor",
    "CompressionError",
    "CompressionStats",
    "PowerSGDState",
    "EncodeContext",
    "build_codec",
    "decompress",
    "derive_seed",
    "leaf_method",
    "from_bytes",
    "to_bytes",
    "wire_nbytes",
    "information_minimum",
    "pack_codes",
    "unpack_codes",
    "packed_nbytes",
    "randomk_positions",
    "topk_indices",
]

