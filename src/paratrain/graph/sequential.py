"""A model seen as a graph of named nodes, with a strategy per (sub)graph.

Nodes are the children of an ``nn.Sequential``; a child that is itself an
``nn.Sequential`` is a *subgraph* whose nodes get dotted names (``"block.fc"``).
``nodes(model)`` is the flattened execution order (what ModelParallel places);
``subgraphs(model)`` lists the nested graphs.

Inheritance (DESIGN §4): ``effective_strategy(path)`` is the node's own strategy,
else its nearest ancestor's, else ``Local``. The root's effective strategy decides how a
job runs. (The Rust 0.5.1 runtime flattens and reads only the root; we also honour
overrides on subgraphs, as its documentation intends.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ConfigError, load_strategy
from ..config.strategy import Local

__all__ = ["nodes", "subgraphs", "get_node", "Graph"]


def _walk(module: nn.Module, prefix: str, leaves: list[str], graphs: list[str]) -> None:
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            graphs.append(full)
            _walk(child, f"{full}.", leaves, graphs)
        else:
            leaves.append(full)


def nodes(model: nn.Module) -> list[str]:
    """Leaf node names in execution order (nested Sequentials flattened, dotted)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"a graph is an nn.Sequential (got {type(model).__name__})")
    leaves: list[str] = []
    _walk(model, "", leaves, [])
    return leaves


def subgraphs(model: nn.Module) -> list[str]:
    """Dotted names of nested nn.Sequential children (the subgraphs)."""
    graphs: list[str] = []
    _walk(model, "", [], graphs)
    return graphs


def get_node(model: nn.Module, name: str) -> nn.Module:
    """The module behind a (dotted) node or subgraph name; KeyError names it."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise KeyError(f"graph has no node {name!r}; nodes: {', '.join(nodes(model))}") from None


class Graph:
    """A model (any ``nn.Module``) plus strategies attached to the root ("") and to any of
    its modules by ``named_modules()`` path (a job's ``[strategy]`` and ``[subgraphs]``)."""

    def __init__(self, model: nn.Module, strategy: Any = None) -> None:
        self.model = model
        self._names = {n for n, _ in model.named_modules() if n}
        self._strategies: dict[str, Any] = {}
        if strategy is not None:
            self.set_strategy("", strategy)

    def set_strategy(self, path: str, strategy: Any) -> None:
        """Attach a strategy (model or JSON dict) to the root ("") or a (sub)graph/node."""
        if path and path not in self._names:
            raise ConfigError(
                [(f"graph[{path!r}]", f"unknown node; nodes: {', '.join(sorted(self._names))}")]
            )
        self._strategies[path] = load_strategy(strategy)

    def strategy(self, path: str = "") -> Any | None:
        """The strategy set on exactly this path, if any."""
        return self._strategies.get(path)

    def effective_strategy(self, path: str = "") -> Any:
        """Own strategy, else the nearest ancestor's, else Local."""
        if path and path not in self._names:
            raise KeyError(f"graph has no node {path!r}")
        probe = path
        while True:
            if probe in self._strategies:
                return self._strategies[probe]
            if not probe:
                return Local()
            probe = probe.rpartition(".")[0]

    def nodes(self) -> list[str]:
        """The modules the traced forward calls, in execution order (torch.fx)."""
        from .trace import trace

        return [str(n.target) for n in trace(self.model).graph.nodes if n.op == "call_module"]
