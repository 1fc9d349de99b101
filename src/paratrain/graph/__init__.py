"""The model as a graph: torch.fx tracing, cutting into parts, and strategies per subgraph.

- :mod:`.trace`: any ``nn.Module`` as an fx graph whose node ids are module qualified names.
- :mod:`.owners`: which rank runs each node of the graph, from the claims on module paths.
- :mod:`.partition`: the graph cut into per-worker parts with the values that cross.

Strategies per module path (a job's ``[strategy]`` and ``[subgraphs]``, inherited from the
nearest ancestor) are :mod:`paratrain.subgraphs`'s.
"""

from .trace import leaf, module_of, trace

__all__ = ["leaf", "trace", "module_of"]
