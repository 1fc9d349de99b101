"""Modules kept whole (*leaves*) in a graph captured by ``torch.export``, which has no such
notion: a leaf's forward may be what export cannot trace, and a tensor-parallel layer runs
collectives (which fake tensors cannot) inside autograd Functions (whose backward export
would drop). So while exporting, each leaf's ``forward`` is one call of the opaque custom op
``paratrain::leaf(xs, key)`` (:func:`kept_whole`), whose fake implementation is the leaf's
``meta_forward`` (a shape function: the TP layers) or its own forward; afterwards
:func:`as_call_modules` turns each such node into ``call_module(<leaf path>)`` on the leaf
itself, so the graph runs its real forward. A leaf takes tensors as positional arguments and
returns one tensor; anything else is a ConfigError naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..config import ConfigError

_ACTIVE: dict[int, tuple[str, nn.Module, Any]] = {}  # key -> (path, module, its own forward)


@torch.library.custom_op("paratrain::leaf", mutates_args=())
def _leaf(xs: list[torch.Tensor], key: int) -> torch.Tensor:
    """Never run: every node calling it becomes a ``call_module`` (:func:`as_call_modules`)."""
    raise RuntimeError("paratrain::leaf only stands for a leaf module while torch.export traces")


@_leaf.register_fake
def _leaf_fake(xs: list[torch.Tensor], key: int) -> torch.Tensor:
    path, module, forward = _ACTIVE[key]
    meta = getattr(module, "meta_forward", None)
    out = meta(*xs) if callable(meta) else forward(*xs)
    if not isinstance(out, torch.Tensor):
        raise ConfigError([("model.leaf_modules", (
            f"{path!r} ({type(module).__name__}) returns {type(out).__name__}; a module kept whole "
            "in a graph captured by torch.export must return one tensor"))])
    # a fresh tensor: the op's output may not alias its inputs
    return out.clone() if any(out is x for x in xs) else out


def _stand_in(key: int, path: str, module: nn.Module) -> Any:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            got = ", ".join([type(a).__name__ for a in args] + [f"{k}=" for k in kwargs])
            raise ConfigError([("model.leaf_modules", (
                f"{path!r} ({type(module).__name__}) is called with ({got}); a module kept whole in "
                "a graph captured by torch.export takes tensors as positional arguments only"))])
        out: torch.Tensor = torch.ops.paratrain.leaf.default(list(args), key)
        return out

    return forward


@contextlib.contextmanager
def kept_whole(model: nn.Module, leaves: Sequence[str]) -> Iterator[None]:
    """While inside, each module of ``model`` at a path in ``leaves`` traces as one
    ``paratrain::leaf`` node (module docstring)."""
    _ACTIVE.clear()
    for key, path in enumerate(leaves):
        m = model.get_submodule(path)
        _ACTIVE[key] = (path, m, m.forward)
        m.forward = _stand_in(key, path, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for _path, m, _ in _ACTIVE.values():
            if "forward" in vars(m):
                del m.forward
        # _ACTIVE stays filled until as_call_modules has read the paths


def as_call_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Every ``paratrain::leaf`` node of ``gm`` (captured inside :func:`kept_whole`) as a
    ``call_module`` of the leaf itself, attached to ``gm`` at its path."""
    op = torch.ops.paratrain.leaf.default
    try:
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or n.target is not op:
                continue
            path = _ACTIVE[int(n.args[1])][0]
            gm.add_submodule(path, model.get_submodule(path))
            with gm.graph.inserting_before(n):
                new = gm.graph.call_module(path, tuple(n.args[0]))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
    finally:
        _ACTIVE.clear()
