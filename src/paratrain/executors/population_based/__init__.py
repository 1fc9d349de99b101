"""PopulationBased: PBT (Jaderberg et al. 2017) over members trained on worker processes
(:mod:`.runner`; the pure maths in :mod:`.pbt`, one member's generation in :mod:`.member`)."""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..spec import ExecutorSpec, capped_workers
from .member import validate_job
from .runner import num_workers, run


def _notes(job: JobConfig) -> list[str]:
    """``run.num_workers`` above ``population_size`` is capped (:func:`.runner.num_workers`)."""
    s: Any = job.strategy
    size = int(s.population_size)
    return capped_workers(job, size, f"a population of {size}")


SPEC = ExecutorSpec(name="PopulationBased", run=run, notes=_notes, validate=validate_job,
                    processes=lambda job: (num_workers(job), "run.num_workers"))
