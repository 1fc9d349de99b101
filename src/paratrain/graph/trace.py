"""Trace any ``nn.Module`` into a torch.fx graph whose module nodes keep their names.

torch's own layers stay single ``call_module`` nodes; a user module is traced into, so its
children appear by their ``named_modules()`` names. A module is kept whole (a *leaf*) when its
path is in ``leaves`` (``model.leaf_modules``) or its class is decorated with :func:`leaf`.
When fx fails and an example input is given, the model is captured with ``torch.export``
instead (:mod:`.export`; a Hugging Face model); a forward neither can capture is a
ConfigError at ``model`` naming the innermost module whose forward failed under fx, how to
mark it a leaf, and export's own error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch.fx as fx
from torch import nn

from ..config import ConfigError
from .export import canonical_ties, export_graph
from .export import module_of as module_of

LEAF_ATTR = "__paratrain_leaf__"
_M = TypeVar("_M", bound=type)


def leaf(cls: _M) -> _M:
    """Class decorator: trace instances of ``cls`` as one node (never into its forward)."""
    setattr(cls, LEAF_ATTR, True)
    return cls


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves or getattr(type(m), LEAF_ATTR, False):
            return True
        return bool(super().is_leaf_module(m, module_qualified_name))

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module: the first to see the error
                try:
                    self.failed_in = self.path_of_module(m)
                except NameError:
                    self.failed_in = type(m).__name__
            raise


def trace(model: nn.Module, leaves: Iterable[str] = (),
          example: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> fx.GraphModule:
    """``model`` as a GraphModule sharing its parameters (see module docstring); a tied
    tensor read by ``get_attr`` under its first name (:func:`.export.canonical_ties`)."""
    wanted = set(leaves)
    known = dict(model.named_modules())
    bad = sorted(p for p in wanted if p not in known or not p)
    if bad:
        raise ConfigError([("model.leaf_modules", f"{', '.join(map(repr, bad))} is not a module "
                            f"of this model; its modules are: {_list(known)}")])
    tracer = _Tracer(wanted)
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one clear error
        if example is not None:
            try:
                gm = export_graph(model, *example, leaves=_outermost(model, wanted))
            except Exception as e2:  # noqa: BLE001 - reported with fx's error below
                why = (str(e2).strip().splitlines() or [type(e2).__name__])[0]
                also = f"; torch.export (non-strict) failed too: {why}"
            else:
                canonical_ties(gm, model)
                return gm
        else:
            also = ""
        where = tracer.failed_in
        what = f"module {where!r} ({type(known[where]).__name__})" if where in known else (
            f"the model's own forward ({type(model).__name__})")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        how = (f"model.leaf_modules = [{where!r}] in the job file, or decorate its class with "
               f"@paratrain.graph.leaf" if where in known and where else
               "a leaf: move the untraceable part into a submodule and list it in "
               "model.leaf_modules")
        raise ConfigError([("model", f"torch.fx cannot trace {what}: {first}{also}. Mark it a "
                            f"leaf (traced as one node, run as-is): {how}")]) from None
    gm = fx.GraphModule(model, graph, type(model).__name__)
    canonical_ties(gm, model)
    return gm


def _outermost(model: nn.Module, wanted: set[str]) -> list[str]:
    """The leaves (listed or of a ``@leaf`` class) not inside another leaf, in model order."""
    out: list[str] = []
    for name, m in model.named_modules():
        if name and (name in wanted or getattr(type(m), LEAF_ATTR, False)) and not any(
                name.startswith(o + ".") for o in out):
            out.append(name)
    return out


def _list(known: dict[str, nn.Module]) -> str:
    names = [n for n in known if n]
    return ", ".join(names[:40]) + (" ..." if len(names) > 40 else "")
