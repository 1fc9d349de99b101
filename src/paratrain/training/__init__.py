"""The loop pieces every executor shares: seeding, optimizers,
checkpoints, run folders, metrics, progress and reports."""

from . import checkpoint, report
from .loop import epoch_permutation, parameters_digest, resolve_device
from .optim import build_optimizer
from .progress import progress_bar
from .rundir import MetricsWriter, prepare_run_dir, read_metrics, write_summary
from .seed import rng_state, seed_everything, set_rng_state

__all__ = [
    "checkpoint", "report", "epoch_permutation", "resolve_device", "parameters_digest", "build_optimizer", "progress_bar", "MetricsWriter",
    "prepare_run_dir", "read_metrics", "write_summary", "rng_state", "seed_everything",
    "set_rng_state",
]
