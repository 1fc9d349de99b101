"""The model as a graph: torch.fx tracing, cutting into parts, and strategies per subgraph.

- :mod:`.trace`: any ``nn.Module`` as an fx graph whose node ids are module qualified names.
- :mod:`.partition`: the graph cut into per-worker parts with the values that cross.
- :mod:`.sequential`: the older view of an ``nn.Sequential`` as a chain of named nodes, and
  :class:`Graph` (strategies attached to the root and to subgraphs).
"""

from .sequential import Graph, get_node, nodes, subgraphs
from .trace import leaf, module_of, trace

__all__ = ["Graph", "get_node", "nodes", "subgraphs", "leaf", "trace", "module_of"]
