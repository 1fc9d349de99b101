"""The loop pieces every executor shares, imported on first use (PEP 562): importing a light
submodule (``gcfreeze``, ``allocator``) does not import torch and the loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import checkpoint, report
    from .loop import resolve_device
    from .optim import build_optimizer
    from .plan import epoch_permutation
    from .progress import progress_bar
    from .rundir import MetricsWriter, prepare_run_dir, read_metrics, write_summary
    from .seed import rng_state, seed_everything, set_rng_state
    from .summary import parameters_digest

__all__ = [
    "checkpoint", "report", "epoch_permutation", "resolve_device", "parameters_digest", "build_optimizer", "progress_bar", "MetricsWriter",
    "prepare_run_dir", "read_metrics", "write_summary", "rng_state", "seed_everything",
    "set_rng_state",
]

# name -> the submodule that defines it (None: the name is the submodule)
_WHERE: dict[str, str | None] = {
    "checkpoint": None, "report": None,
    "epoch_permutation": "plan", "parameters_digest": "summary", "resolve_device": "loop",
    "build_optimizer": "optim", "progress_bar": "progress",
    "MetricsWriter": "rundir", "prepare_run_dir": "rundir", "read_metrics": "rundir",
    "write_summary": "rundir",
    "rng_state": "seed", "seed_everything": "seed", "set_rng_state": "seed",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    module = importlib.import_module(f"{__name__}.{where or name}")
    value = module if where is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
