"""Running a job (the CLI, :func:`paratrain.fit` and ``python -m paratrain.worker`` all do it
through :func:`execute`): every check, the ignored-settings warnings, then ``run`` of the job's
:class:`~paratrain.executors.spec.ExecutorSpec`."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

from .config import effective as _job_rules
from .config.effective import Effective
from .config.job import JobConfig
from .executors import spec_for, worker_preload


def execute(
    job: JobConfig, *, resume: bool = False, overwrite: bool = False, job_dir: Path | None = None,
    instances: Any = None,
) -> dict[str, Any]:
    """Run ``job`` under its strategy and return the summary; never falls back to Local.
    ``job_dir`` anchors relative ``run.imports``; ``instances`` (from :func:`paratrain.fit`)
    are checked as the specs they replace, then trained by the Local executor. Ignored
    settings are warned about once, by the launching process (rank 0 under torchrun)."""
    launcher = os.environ.get("RANK", "0") == "0"
    preload = worker_preload(job) if instances is None else []
    if preload:
        # the workers' forkserver imports torch and their modules on the other core while
        # this process runs the checks: a launch no longer waits for the two in turn
        from .comm.forkserver import warm

        warm(preload)
    from .preflight import preflight
    from .training import report
    from .training.gcfreeze import resume_collections
    from .training.threads import intra_op_threads, use_threads

    preflight(job, job_dir=job_dir, warn=launcher, instances=instances)  # as `paratrain validate`
    spec = spec_for(job)
    if launcher:
        for item in effective_settings(job, resume=resume).ignored:
            warnings.warn(str(item), _job_rules.IgnoredSettingWarning, stacklevel=2)
    # a Local run trains here, with the job's intra-op thread count (the caller's put back after)
    threads = use_threads(intra_op_threads(job)) if spec.name == "Local" else contextlib.nullcontext()
    if spec.name == "Local":
        report.import_in_background()  # report.png's matplotlib, off the end of the run
    else:  # the Local executor resumes once its model and optimizer are built
        resume_collections()  # the CLI's start-up pause (training.gcfreeze) ends here
    with threads:
        if instances is not None:
            return spec.run(job, resume=resume, overwrite=overwrite, model=instances.model,
                            data=instances.data, task=instances.task)
        return spec.run(job, resume=resume, overwrite=overwrite)


def effective_settings(job: JobConfig, *, resume: bool = False, probe: bool = True) -> Effective:
    """What ``job`` runs with and every setting it sets that the run ignores: the rules the
    job alone tells (:func:`paratrain.config.effective.effective_settings`), then its
    executor's own (``ExecutorSpec.ignores``; ``probe`` lets them build the model, e.g. the
    tensor-parallel ``memory_optimization`` / ``fusion_threshold_bytes`` checks)."""
    base = _job_rules.effective_settings(job, resume=resume)
    hook = spec_for(job).ignores
    if hook is None:
        return base
    extra = hook(job, resume=resume, probe=probe)
    return Effective(settings={**base.settings, **extra.settings},
                     ignored=[*base.ignored, *extra.ignored])
