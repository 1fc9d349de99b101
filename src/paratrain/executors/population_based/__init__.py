"""PopulationBased: PBT (Jaderberg et al. 2017) over members trained on worker processes.

- :mod:`.pbt`: the pure, seeded maths (search space, exploit/explore, population state);
- :mod:`.hyperparams`: hyperparameter roles, the fitness metric, the job's checks;
- :mod:`.member_state`: member files, digests, seeds, the background checkpoint writer;
- :mod:`.member`: one member's training, through the one training loop;
- :mod:`.report`: lineage and the population's summary;
- :mod:`.runner`: launch, the exploit/explore rounds, checkpoints.
"""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..spec import ExecutorSpec, capped_workers
from .hyperparams import validate_job
from .runner import num_workers, run

__all__ = ["SPEC", "run"]


def _processes(job: JobConfig) -> tuple[int, str]:
    return num_workers(job), "run.num_workers"


def _notes(job: JobConfig) -> list[str]:
    """``run.num_workers`` above ``population_size`` is capped (:func:`.runner.num_workers`)."""
    s: Any = job.strategy
    size = int(s.population_size)
    return capped_workers(job, size, f"a population of {size}")


SPEC = ExecutorSpec(name="PopulationBased", run=run, processes=_processes, notes=_notes,
                    validate=validate_job)
