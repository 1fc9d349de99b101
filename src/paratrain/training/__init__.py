"""The loop pieces every executor shares, imported on first use (PEP 562): importing a light
submodule (``gcfreeze``, ``allocator``) does not import torch and the loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..comm.process import resolve_device
    from ..data.loader import seed_everything
    from . import checkpoint, report
    from .loop import epoch_permutation
    from .optim import build_optimizer
    from .progress import progress_bar
    from .rundir import MetricsWriter, prepare_run_dir, read_metrics, write_summary
    from .summary import parameters_digest

__all__ = [
    "checkpoint", "report", "epoch_permutation", "resolve_device", "parameters_digest",
    "build_optimizer", "progress_bar", "MetricsWriter", "prepare_run_dir", "read_metrics",
    "write_summary", "seed_everything",
]

# name -> the module that defines it (relative to this package)
_WHERE = {
    "checkpoint": ".checkpoint", "report": ".report", "epoch_permutation": ".loop",
    "resolve_device": "..comm.process", "parameters_digest": ".summary", "build_optimizer": ".optim",
    "progress_bar": ".progress", "MetricsWriter": ".rundir", "prepare_run_dir": ".rundir",
    "read_metrics": ".rundir", "write_summary": ".rundir", "seed_everything": "..data.loader",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name], __name__)
    value = module if _WHERE[name] == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
