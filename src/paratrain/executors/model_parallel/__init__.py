"""ModelParallel: the model's nodes placed on worker processes, pipelined (DESIGN §5).

- :mod:`.plan`: which nodes run on which stage (a pure function of the job);
- :mod:`.schedule`: GPipe / 1F1B micro-batch orders (pure);
- :mod:`.runtime`: one stage's forward/backward with point-to-point activations;
- :mod:`.engine`: the stage's part of the one training loop (engine, checkpoints, stats);
- :mod:`.runner`: validation, launch and a rank's run (``worker_main``).
"""

from .runner import run, worker_main

__all__ = ["run", "worker_main"]
