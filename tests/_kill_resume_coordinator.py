"""A Custom coordinator for tests/training/test_kill_resume_matrix.py, loaded through ``run.imports``.

It trains the job's model through paratrain's own loop: a Local run of the same job in
``<run folder>/inner`` (the pattern of ``examples/custom_ensemble.py``), told about
``--resume``. So what the loop guarantees -- a checkpoint on SIGINT/SIGTERM, resume after a
SIGKILL mid-step or mid-save, bit-identical parameters -- holds under Custom; a coordinator
that trains by its own means owns its resume itself (paratrain only tells it ``resume``)."""

from __future__ import annotations

from typing import Any

from paratrain.config import Local
from paratrain.config.job import JobConfig
from paratrain.executors import local, register_coordinator
from paratrain.training import write_summary


@register_coordinator("kill-resume-own-loop")
def own_loop(job: JobConfig, config: Any, *, resume: bool = False) -> dict[str, Any]:
    del config
    run_dir = f"{job.run.output_dir}/{job.run.name}"
    inner = job.model_copy(update={
        "strategy": Local(),
        "run": job.run.model_copy(update={"output_dir": run_dir, "name": "inner", "imports": []}),
    })
    done = local.run(inner, resume=resume)
    out = {"strategy": "Custom", "coordinator": "kill-resume-own-loop", "run_dir": run_dir,
           "steps": done["steps"], "parameters_sha256": done["parameters_sha256"]}
    write_summary(run_dir, out)
    return out
