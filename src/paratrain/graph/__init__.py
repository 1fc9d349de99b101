"""The model as a graph: torch.fx tracing (:mod:`.trace`), each node's rank (:mod:`.owners`)
and the graph cut into per-worker parts (:mod:`.partition`)."""

from .trace import leaf, module_of, trace

__all__ = ["leaf", "trace", "module_of"]
