"""What a value or a module of a traced graph weighs: the shape, dtype and bytes ShapeProp
recorded on a node (:func:`tensor_metas`, :func:`shape_info`), the elements of some tensors
each counted once (:func:`count_elements`), the tensor at a dotted path (:func:`tensor_at`).
``paratrain graph``'s report (:mod:`paratrain.explain`) and the executors' parts of it use them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn


def tensor_metas(meta: Any) -> list[Any]:
    """The TensorMetadata leaves of a ShapeProp result (a tensor, or tuples/dicts of them)."""
    if meta is None:
        return []
    if hasattr(meta, "shape") and hasattr(meta, "dtype"):
        return [meta]
    if isinstance(meta, Mapping):
        return [m for v in meta.values() for m in tensor_metas(v)]
    if isinstance(meta, list | tuple):
        return [m for v in meta for m in tensor_metas(v)]
    return []


def shape_info(metas: list[Any]) -> tuple[Any, str | None, int | None]:
    """``(shape, dtype, bytes)`` of ``metas`` (a list of shapes when there are several;
    ``(None, None, None)`` when there are none)."""
    if not metas:
        return None, None, None
    shapes = [list(m.shape) for m in metas]
    dtypes = sorted({str(m.dtype).removeprefix("torch.") for m in metas})
    nbytes = sum(math.prod(m.shape) * m.dtype.itemsize for m in metas)
    return (shapes[0] if len(shapes) == 1 else shapes), ",".join(dtypes), int(nbytes)


def count_elements(tensors: Sequence[torch.Tensor]) -> int:
    """The elements of ``tensors``, a tensor listed twice (a tied weight) counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel()
    return total


def tensor_at(model: nn.Module, target: str) -> torch.Tensor | None:
    """The parameter or buffer at dotted ``target`` of ``model`` (None if there is none)."""
    try:
        obj: Any = functools.reduce(getattr, target.split("."), model)
    except AttributeError:
        return None
    return obj if isinstance(obj, torch.Tensor) else None
