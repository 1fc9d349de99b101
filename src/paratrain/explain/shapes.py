"""The shapes in an explain report: :class:`torch.fx.passes.shape_prop.ShapeProp` over one
training batch of ``train.batch_size`` rows (``meta['tensor_meta']`` on every node of the
traced graph; read back by :mod:`paratrain.graph.sizes`).

Shapes are extra information only: when the model cannot run on the batch, :func:`propagate`
returns the reason and the report leaves them out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["propagate"]


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
