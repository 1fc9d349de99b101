"""What goes into and comes out of the cut model: a batch's rows and the model's arguments,
the graph's inputs and the model's output, and the tensors this rank holds.

A batch is any pytree of tensors; micro-batch ``i`` is rows ``[a_i, b_i)`` of every leaf with
a leading dimension (:func:`rows_of`). A *feed* ``batch -> (args, kwargs)`` says how a batch
calls the model (the task's ``model_args``; :func:`first_field` by default). The cut's inputs
are the forward's parameters under torch.fx, the leaves of ``(args, kwargs)`` under
torch.export (``Cut.in_spec``); the model's output is the cut's output structure filled in
(under torch.export unflattened by ``Cut.out_spec``: a ``ModelOutput`` again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...graph.partition import Cut
from .plan import Plan

#: ``batch -> (args, kwargs)``: how a batch calls the model.
Feed = Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]


class Transport(Protocol):
    def send(self, tensor: torch.Tensor, *, dst: int, key: tuple[str, int, int], step: int = 0,
             rows: int | None = None) -> None: ...
    def recv(self, *, src: int, key: tuple[str, int, int], step: int = 0,
             rows: int | None = None) -> torch.Tensor: ...
    def flush(self) -> None: ...


def first_field(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The default feed: ``model(batch[0])`` (a bare tensor: ``model(batch)``)."""
    return ((batch[0],) if isinstance(batch, tuple | list) else (batch,)), {}


def batch_rows(tree: Any) -> int:
    """The leading size of the first tensor leaf with one (1 when there is none)."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def rows_of(tree: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of every tensor leaf with a leading dimension."""
    return pytree.tree_map(
        lambda t: t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, tree)


def storages(tree: Any) -> set[int]:
    """Storage addresses of the tensor leaves (the batch is not an activation)."""
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor)}


def model_inputs(cut: Cut, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Each graph input's value for a model call ``(args, kwargs)`` (module docstring)."""
    if cut.capture == "export":
        order = _kwarg_order(cut.in_spec)
        if order is not None and set(order) == set(kwargs):
            kwargs = {k: kwargs[k] for k in order}
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        if len(leaves) != len(cut.inputs):
            raise ValueError(
                f"the model was captured with {len(cut.inputs)} input tensors "
                f"({', '.join(cut.inputs)}) but this batch calls it with {len(leaves)}: batches "
                f"must have the structure of the one it was captured on")
        return dict(zip(cut.inputs, leaves, strict=True))
    out: dict[str, Any] = {}
    for i, name in enumerate(cut.inputs):
        if i < len(args):
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        else:
            out[name] = cut.input_defaults.get(name)
    return out


def _kwarg_order(spec: Any) -> list[str] | None:
    children = spec.children() if callable(getattr(spec, "children", None)) else None
    if not children or len(children) != 2:
        return None
    context = getattr(children[1], "context", None)
    return list(context) if isinstance(context, list | tuple) else None


def model_output(cut: Cut, env: dict[str, Any]) -> Any:
    """The model's output from the values in ``env`` (rebuilt as the model returns it)."""
    out = fx.node.map_aggregate(cut.output, lambda a: env[a] if isinstance(a, str) and a in env else a)
    if cut.out_spec is not None:
        return pytree.tree_unflatten(list(out) if isinstance(out, tuple | list) else [out],
                                     cut.out_spec)
    return out


def segment_modules(model: nn.Module, plan: Plan, rank: int) -> dict[int, nn.Module]:
    """This rank's parts as modules (fx GraphModules sharing the model's parameters)."""
    del model  # the parts were cut from it and hold its modules
    return {p.index: p.module for p in plan.segments_of(rank)}


def held_attrs(model: nn.Module, plan: Plan, rank: int) -> dict[str, torch.Tensor]:
    """Parameters/buffers read by ``get_attr`` that ``rank`` holds: value name -> tensor."""
    out: dict[str, torch.Tensor] = {}
    for a in plan.cut.attrs:
        if a.rank == rank:
            out[a.name] = a.value(model)
    return out
