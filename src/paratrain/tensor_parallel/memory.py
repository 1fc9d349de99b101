"""Activation memory: checkpointing levels and a meter of the bytes saved for backward.

``memory_optimization`` maps to activation checkpointing of consecutive *blocks* (a block
starts at a tensor-parallel unit and runs to the next): None = keep every activation;
Low / Medium / High = checkpoint segments of 4 / 2 / 1 blocks (Chen et al. 2016, "Training
Deep Nets with Sublinear Memory Cost": only segment inputs are kept, the rest is
recomputed in backward); Extreme = segments of 1 block, and every tensor saved for
backward is moved to host memory while it waits (``save_on_cpu`` style offload), which
on an accelerator takes the saved activations off the device.

:class:`ActivationMeter` measures what a level costs: through ``saved_tensors_hooks`` it
tracks the bytes of distinct non-parameter tensors held for backward on the compute
device, live, including the tensors re-created by recomputation during backward, and
keeps the peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SEGMENT_BLOCKS", "ActivationMeter", "activation_hooks", "measure"]

# memory_optimization -> blocks per checkpoint segment (0 = no checkpointing)
SEGMENT_BLOCKS = {"None": 0, "Low": 4, "Medium": 2, "High": 1, "Extreme": 1}


class _Saved:
    __slots__ = ("tensor", "device", "__weakref__")

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.tensor, self.device = tensor, device


class ActivationMeter:
    """Live and peak bytes of activations saved for backward (device-resident only)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.offloaded_peak = 0
        self._offloaded = 0
        self._refs: dict[tuple[int, int], int] = {}

    def _add(self, key: tuple[int, int], nbytes: int) -> None:
        n = self._refs.get(key, 0)
        self._refs[key] = n + 1
        if n == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _drop(self, key: tuple[int, int], nbytes: int) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)
            self.live -= nbytes
        else:
            self._refs[key] = n

    def _offload(self, nbytes: int, sign: int) -> None:
        self._offloaded += sign * nbytes
        self.offloaded_peak = max(self.offloaded_peak, self._offloaded)


_ACTIVE: list[ActivationMeter] = []


@contextmanager
def activation_hooks(*, offload: bool, params: set[int] | None = None) -> Iterator[None]:
    """Saved-tensor hooks: count into the active meter (if any) and offload when asked.

    Parameters (by data pointer in ``params``) are not activations and are not counted
    or moved.
    """
    meter = _ACTIVE[-1] if _ACTIVE else None
    params = params or set()

    def pack(t: torch.Tensor) -> Any:
        if t.data_ptr() in params or t.numel() == 0:
            return t
        nbytes = t.untyped_storage().nbytes()
        dev = t.device
        if offload and dev.type != "cpu":
            host = t.to("cpu", non_blocking=True)
            box = _Saved(host, dev)
            if meter is not None:
                meter._offload(nbytes, +1)
                weakref.finalize(box, meter._offload, nbytes, -1)
            return box
        box = _Saved(t, dev)
        if meter is not None:
            key = (t.untyped_storage().data_ptr(), nbytes)
            meter._add(key, nbytes)
            weakref.finalize(box, meter._drop, key, nbytes)
        return box

    def unpack(box: Any) -> torch.Tensor:
        if isinstance(box, _Saved):
            return box.tensor.to(box.device, non_blocking=True)
        return box  # type: ignore[no-any-return]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextmanager
def measure(*, params: set[int] | None = None, offload: bool = False) -> Iterator[ActivationMeter]:
    """Activate a meter for everything run (forward and backward) inside the block.

    Hooks are pushed here too, so tensors saved while recomputing checkpointed segments
    during backward are counted as well.
    """
    meter = ActivationMeter()
    _ACTIVE.append(meter)
    try:
        with activation_hooks(offload=offload, params=params):
            yield meter
    finally:
        _ACTIVE.pop()
