"""paratrain: train PyTorch models under a declared training strategy."""

from __future__ import annotations

from typing import Any

__all__ = ["fit", "__version__"]
__version__ = "0.1.0"


def fit(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Train and return the summary dict (see :func:`paratrain.api.fit`)."""
    from .api import fit as _fit

    return _fit(*args, **kwargs)
