"""What a :mod:`paratrain.comm.dcp` checkpoint is made of (:class:`Box`, :class:`Target`,
:data:`Piece`), apart so that code describing checkpoints imports in milliseconds:
torch.distributed.checkpoint imports DTensor and its operator table (about 0.7 s of a Local
run's start on 2 cores), needed only when a run first saves or resumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METADATA = ".metadata"  # the file DCP's FileSystemWriter writes last, on the coordinator


@dataclass(frozen=True)
class Box:
    """Where a process's piece lies in the whole tensor: ``shape`` is the whole tensor's,
    ``offsets`` the piece's first index in each dimension."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Target:
    """A tensor to fill from the checkpoint: ``tensor`` (this process's piece), ``box`` (None: it is
    the whole tensor) and ``sources``, the checkpoint keys to read it from, most preferred first."""

    tensor: torch.Tensor
    box: Box | None
    sources: tuple[str, ...]


Piece = tuple[str, torch.Tensor, "Box | None"]


class MissingRegion(ValueError):
    """No key of a target's ``sources`` holds part of the region it needs."""
