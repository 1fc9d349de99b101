"""paratrain: train PyTorch models under a declared training strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .task.protocol import Task

__all__ = ["fit", "load_model", "Task", "__version__"]
__version__ = "0.1.0"


def fit(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Train and return the summary dict (see :func:`paratrain.api.fit`)."""
    from .api import fit as _fit

    return _fit(*args, **kwargs)


def load_model(run_dir: Any, *, client: int | None = None) -> dict[str, Any]:
    """The trained model of a finished run as one state_dict under the model's own names
    (see :func:`paratrain.training.export.load_model`): ``model.load_state_dict(state)``."""
    from .training.export import load_model as _load

    return _load(run_dir, client=client)


def __getattr__(name: str) -> Any:
    """``paratrain.Task`` (the task protocol, :mod:`paratrain.task`), imported on first use."""
    if name == "Task":
        from .task.protocol import Task

        return Task
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
