"""The shapes in an explain report: :class:`torch.fx.passes.shape_prop.ShapeProp` over one
training batch of ``train.batch_size`` rows (``meta['tensor_meta']`` on every node of the
traced graph), and the shape, dtype and bytes of the value a node computes.

Shapes are extra information only: when the model cannot run on the batch, :func:`propagate`
returns the reason and the report leaves them out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

__all__ = ["tensor_metas", "shape_info", "propagate"]


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


def propagate(gm: fx.GraphModule, job: Any, train: Any) -> str | None:
    """ShapeProp over one training batch (``meta['tensor_meta']`` on every node); the reason
    when it could not run (shapes are then left out)."""
    from torch.fx.passes.shape_prop import ShapeProp

    from ..task import fetch_batch, model_args

    try:
        rows = max(1, min(int(job.train.batch_size), len(train)))
        batch = fetch_batch(train, torch.arange(rows))
        args, kwargs = model_args(None, batch)
        if kwargs:  # ShapeProp feeds placeholders positionally only
            return "the model takes keyword arguments (a dict batch): shapes left out"
        with torch.no_grad():
            ShapeProp(gm).propagate(*args)
    except Exception as e:  # noqa: BLE001 - shapes are extra information only
        return (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
    return None
