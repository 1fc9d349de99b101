"""Population-based training maths (Jaderberg et al. 2017): pure, seeded, no I/O.

- :mod:`.space`: sample / perturb / validate search-space dimensions;
- :mod:`.evolve`: exploit (Truncation, Binary) and explore (Perturbation, Resample);
- :mod:`.population`: the population state with ``state_dict``, its generator, lineage.

The executor that trains members on worker processes is
:mod:`paratrain.executors.population_based.runner`.
"""

from .evolve import (
    Copy,
    evolve,
    exploit,
    exploit_binary,
    exploit_truncation,
    explore,
    score,
    truncation_cutoff,
)
from .population import PopulationState, ancestry, lineage_json
from .space import in_dim, perturb_dim, sample_dim, sample_space, validate_space

__all__ = [
    "Copy", "evolve", "exploit", "exploit_binary", "exploit_truncation", "explore", "score",
    "truncation_cutoff", "PopulationState", "ancestry", "lineage_json", "in_dim",
    "perturb_dim", "sample_dim", "sample_space", "validate_space",
]
