"""paratrain: train PyTorch models under a declared training strategy."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import fit
    from .task.steps import Task
    from .training.export import load_model

__all__ = ["fit", "load_model", "Task", "__version__"]
__version__ = "0.1.0"

# imported on first use, so that `import paratrain` stays light
_LAZY = {"fit": ".api", "load_model": ".training.export", "Task": ".task.steps"}


def __getattr__(name: str) -> Any:
    """``paratrain.fit`` (:func:`paratrain.api.fit`), ``paratrain.load_model``
    (:func:`paratrain.training.export.load_model`) and ``paratrain.Task`` (the task protocol)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
