"""PopulationBased: PBT (Jaderberg et al. 2017) over members trained on worker processes.

- :mod:`.pbt`: the pure, seeded maths (search space, exploit/explore, population state);
- :mod:`.hyperparams`: hyperparameter roles, the fitness metric, the job's checks;
- :mod:`.member_state`: member files, digests, seeds, the background checkpoint writer;
- :mod:`.member`: one member's training, through the one training loop;
- :mod:`.report`: lineage and the population's summary;
- :mod:`.runner`: launch, the exploit/explore rounds, checkpoints.
"""

from .runner import run, worker_main

__all__ = ["run", "worker_main"]
