"""Activation memory: recomputation levels, the tape of collective outputs, and a meter of the
bytes saved for backward. ``memory_optimization`` checkpoints segments of 4 / 2 / 1 / 1 blocks
(Low / Medium / High / Extreme, Chen et al. 2016; Extreme also moves saved tensors to host).
No level recomputes communication: every collective of a segment's forward writes its output on
the segment's :class:`CollectiveTape`, and the recomputation, reaching the same collectives in
the same order, reads them back (Korthikanti et al. 2022, §5), so every level moves None's
bytes. Low and Medium also tape the sharded matmuls' outputs (selective). An entry changed in
place since it was recorded, or a call past the end of the tape, runs the collective instead;
every rank makes the same choice, so collectives match.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# memory_optimization -> blocks per checkpoint segment (0 = no checkpointing)
SEGMENT_BLOCKS = {"None": 0, "Low": 4, "Medium": 2, "High": 1, "Extreme": 1}
# the levels whose tapes also keep the sharded matmuls' outputs (selective recomputation)
SELECTIVE = frozenset({"Low", "Medium"})


class _Saved:
    __slots__ = ("tensor", "device", "__weakref__")

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.tensor, self.device = tensor, device


class ActivationMeter:
    """Live and peak bytes of the distinct non-parameter tensors saved for backward on the
    compute device (those re-created by recomputation and held on tapes included)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
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


_ACTIVE: list[ActivationMeter] = []


@contextmanager
def activation_hooks(*, offload: bool, params: set[int] | None = None) -> Iterator[None]:
    """Saved-tensor hooks: count into the active meter (if any) and offload when asked;
    parameters (by data pointer in ``params``) are neither counted nor moved."""
    meter = _ACTIVE[-1] if _ACTIVE else None
    params = params or set()

    def pack(t: torch.Tensor) -> Any:
        if t.data_ptr() in params or t.numel() == 0:
            return t
        return _box(t, offload, meter)

    def unpack(box: Any) -> torch.Tensor:
        if isinstance(box, _Saved):
            return box.tensor.to(box.device, non_blocking=True)
        return box  # type: ignore[no-any-return]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextmanager
def measure(*, params: set[int] | None = None, offload: bool = False) -> Iterator[ActivationMeter]:
    """Meter everything run inside the block, forward and backward (the recomputation
    of checkpointed segments included)."""
    meter = ActivationMeter()
    _ACTIVE.append(meter)
    try:
        with activation_hooks(offload=offload, params=params):
            yield meter
    finally:
        _ACTIVE.pop()


def _box(t: torch.Tensor, offload: bool, meter: ActivationMeter | None) -> _Saved:
    """Hold ``t`` as a saved activation: counted in ``meter`` while it is held, or moved to
    host memory under offload."""
    if offload and t.device.type != "cpu":
        return _Saved(t.to("cpu", non_blocking=True), t.device)
    box = _Saved(t, t.device)
    if meter is not None:
        nbytes = t.untyped_storage().nbytes()
        key = (t.untyped_storage().data_ptr(), nbytes)
        meter._add(key, nbytes)
        weakref.finalize(box, meter._drop, key, nbytes)
    return box


class CollectiveTape:
    """The outputs of one checkpointed segment's forward collectives, in call order: the
    first run records them, every later run (the recomputation) gets the ``i``-th output back
    at its ``i``-th collective, released from the tape as it is handed over."""

    def __init__(self, *, offload: bool = False, keep_matmuls: bool = False,
                 on_replay: Callable[[], None] | None = None) -> None:
        self.offload, self.keep_matmuls = offload, keep_matmuls
        self._on_replay = on_replay
        self._entries: list[tuple[tuple[_Saved, ...], tuple[int, ...], bool, bool] | None] = []
        self._recorded = False
        self._pos = 0

    @contextmanager
    def run(self) -> Iterator[None]:
        """One run of the segment: the first records, the later ones replay."""
        replay = self._recorded
        self._pos = 0
        _TAPES.append((self, replay))
        try:
            yield
        finally:
            _TAPES.pop()
            self._recorded = True
            if replay:  # what the recomputation did not take back (early stop) is not needed
                self._entries.clear()

    def _record(self, out: Any, matmul: bool) -> Any:
        outs = out if isinstance(out, tuple) else (out,)
        meter = _ACTIVE[-1] if _ACTIVE else None
        boxes = tuple(_box(t.detach(), self.offload, meter) for t in outs)
        # an alias shares the output's version counter: an in-place change shows
        self._entries.append((boxes, tuple(b.tensor._version for b in boxes), isinstance(out, tuple),
                              matmul))
        return out

    def _replay(self, collective: Callable[[], Any]) -> Any:
        i = self._pos
        self._pos += 1
        entry = self._entries[i] if i < len(self._entries) else None
        if entry is None:
            return collective()
        self._entries[i] = None
        boxes, versions, is_tuple, matmul = entry
        if any(b.tensor._version != v for b, v in zip(boxes, versions, strict=True)):
            return collective()  # changed in place after the collective: not its output
        if self._on_replay is not None and not matmul:
            self._on_replay()
        outs = tuple(b.tensor.to(b.device, non_blocking=True) if b.tensor.device != b.device
                     else b.tensor.detach() for b in boxes)
        return outs if is_tuple else outs[0]

    def __len__(self) -> int:
        return sum(e is not None for e in self._entries)


_TAPES: list[tuple[CollectiveTape, bool]] = []


def keeps_matmuls() -> bool:
    """Whether the innermost active tape keeps the sharded matmuls' outputs (selective)."""
    return bool(_TAPES) and _TAPES[-1][0].keep_matmuls


def taped(collective: Callable[[], Any], *, matmul: bool = False) -> Any:
    """Run a forward collective (a tensor or a tuple of them) through the innermost active tape,
    if any. ``matmul``: a sharded layer's local product, taped only at the selective levels."""
    if not _TAPES:
        return collective()
    tape, replay = _TAPES[-1]
    if matmul and not tape.keep_matmuls:
        return collective()
    if replay:
        return tape._replay(collective)
    return tape._record(collective(), matmul)
