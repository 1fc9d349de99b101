"""The model as a graph: torch.fx tracing, torch.export where fx fails (:mod:`.trace`), and
the graph cut into per-worker parts, each node on its rank (:mod:`.partition`)."""

from .trace import leaf, module_of, trace

__all__ = ["leaf", "trace", "module_of"]
