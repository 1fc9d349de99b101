"""Tensor parallelism (Megatron-style) as an executor: Local or DataParallel jobs with
``tensor_parallel_size > 1`` (DESIGN §6). The sharding itself is :mod:`paratrain.tensor_parallel`.

- :mod:`.runner`: launch, the TP(×DP) grid set-up and its part of the one training loop.
"""

from .runner import run, worker_main

__all__ = ["run", "worker_main"]
