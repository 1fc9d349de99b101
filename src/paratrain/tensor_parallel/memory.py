"""Activation memory: recomputation levels, the tape of collective outputs, and a meter of
the bytes saved for backward.

``memory_optimization`` maps to activation checkpointing of consecutive *blocks* (a block
starts at a tensor-parallel unit and runs to the next; a model that is not an
``nn.Sequential`` of paratrain's blocks, e.g. HF's, is one segment at every level):

=========  ==========================================  ======================================
level      stored for backward                         recomputed in backward
=========  ==========================================  ======================================
None       every activation                            nothing
Low        segment inputs (every 4 blocks), the        norms, activations, the attention
           outputs of the forward collectives and of   core, dropout, residual adds: the
           the sharded (column) matmuls                cheap ops (selective recomputation)
Medium     as Low, segments of 2 blocks (the default)  as Low
High       segment inputs (every block) and the        all the local maths, the column
           outputs of the forward collectives          matmuls too
Extreme    as High, on host memory while it waits      as High
=========  ==========================================  ======================================

Checkpointing is Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"); Extreme
moves every saved tensor to host memory while it waits (``save_on_cpu`` style), which on an
accelerator takes the saved activations off the device (on a CPU it is High).

No level recomputes communication. Every collective run in a segment's forward (the row
layer's all-reduce or reduce-scatter, the sequence all-gathers, the gathers of an output,
the 2-D panels) writes its output on the segment's :class:`CollectiveTape`; when backward
recomputes the segment, the same collectives, reached in the same order, read their outputs
back from the tape instead of communicating again. This is the split of Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", §5, selective
activation recomputation): recompute what is cheap to recompute, store what is expensive,
and a collective's output is the most expensive of all, since it costs the network and every
rank's time. Every level therefore moves exactly the bytes of ``None`` per step
(``CommStats.replayed`` counts the collectives the tape saved). A row layer's partial matmul
runs inside its taped collective, so a replay skips it as well. Low and Medium tape the
column layers' products too, so their recomputation is Korthikanti's selective set (for a
transformer layer: the layer norms, GELU, the attention scores and softmax, dropout); High
and Extreme keep only the collectives' outputs (for a transformer layer two ``[b, s, h]``
tensors, the attention's and the MLP's row outputs) and recompute the column matmuls as
well: the least memory, the most compute. (``TensorParallelModule.recompute_collectives =
True`` is the policy before the tape, which ran the forward collectives again and stored
only segment inputs: kept to measure what the tape saves.)

A tape entry whose tensor was changed in place after the collective (its version counter
moved) is not trusted: that collective runs again, as does any collective reached after
the tape has been used up (a second backward through a retained graph). Ranks run the same
code, so they make the same choice and the collectives stay matched.

:class:`ActivationMeter` measures what a level costs: through ``saved_tensors_hooks`` it
tracks the bytes of distinct non-parameter tensors held for backward on the compute
device, live, including the tensors re-created by recomputation during backward and the
tensors held on collective tapes, and keeps the peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SEGMENT_BLOCKS", "SELECTIVE", "ActivationMeter", "CollectiveTape", "activation_hooks", "keeps_matmuls",
           "measure", "taped"]

# memory_optimization -> blocks per checkpoint segment (0 = no checkpointing)
SEGMENT_BLOCKS = {"None": 0, "Low": 4, "Medium": 2, "High": 1, "Extreme": 1}
# the levels whose tapes also keep the sharded matmuls' outputs (selective recomputation)
SELECTIVE = frozenset({"Low", "Medium"})


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
        return _box(t, offload, meter)

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


def _box(t: torch.Tensor, offload: bool, meter: ActivationMeter | None) -> _Saved:
    """Hold ``t`` as a saved activation: counted in ``meter`` while it is held, or moved to
    host memory under offload (counted as offloaded)."""
    nbytes = t.untyped_storage().nbytes()
    if offload and t.device.type != "cpu":
        box = _Saved(t.to("cpu", non_blocking=True), t.device)
        if meter is not None:
            meter._offload(nbytes, +1)
            weakref.finalize(box, meter._offload, nbytes, -1)
        return box
    box = _Saved(t, t.device)
    if meter is not None:
        key = (t.untyped_storage().data_ptr(), nbytes)
        meter._add(key, nbytes)
        weakref.finalize(box, meter._drop, key, nbytes)
    return box


class CollectiveTape:
    """The outputs of one checkpointed segment's forward collectives, in call order.

    The segment's first run *records* (each collective runs and its output is kept, as an
    alias that shares the version counter); every later run (the recomputation in backward)
    *replays*: the ``i``-th collective it reaches returns the ``i``-th recorded output, which
    is released from the tape as it is handed over (the recomputed graph holds it from then
    on). An entry changed in place since it was recorded, or a call past the end of the tape,
    runs the collective instead (see the module docstring).
    """

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
    """Run a forward collective (returning a tensor or a tuple of tensors) through the
    innermost active tape, if any: recorded on a segment's first run, read back instead of
    run when the segment is recomputed. ``matmul``: a sharded layer's local product, taped
    only by a tape that keeps matmuls (the selective levels), else simply run."""
    if not _TAPES:
        return collective()
    tape, replay = _TAPES[-1]
    if matmul and not tape.keep_matmuls:
        return collective()
    if replay:
        return tape._replay(collective)
    return tape._record(collective(), matmul)
