"""Custom: user coordinators registered by name (``@register_coordinator("name")``).

A coordinator is ``fn(job: JobConfig, config: JSON) -> dict`` (the summary), given the whole
job, so every section is its to use. One that declares a ``resume`` keyword (or ``**kwargs``)
is told about ``--resume``; for one without it ``--resume`` is reported as ignored. An
unknown name is an error listing the registered ones; there is no fallback to Local.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..config import ConfigError
from ..config.effective import Effective, Ignored
from ..config.job import JobConfig
from .plugins import keywords
from .spec import ExecutorSpec

Coordinator = Callable[..., dict[str, Any]]
_REGISTRY: dict[str, Coordinator] = {}


def register_coordinator(name: str) -> Callable[[Coordinator], Coordinator]:
    if not name or not isinstance(name, str):
        raise ValueError(f"coordinator name must be a non-empty string (got {name!r})")

    def deco(fn: Coordinator) -> Coordinator:
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_coordinators() -> list[str]:
    return sorted(_REGISTRY)


def coordinator(job: JobConfig) -> Coordinator:
    """The job's registered coordinator; a ConfigError listing the registered ones."""
    name = getattr(job.strategy, "coordinator", None)
    if name not in _REGISTRY:
        hint = (", ".join(registered_coordinators())
                or "none registered (list the module that registers it in run.imports)")
        raise ConfigError([("strategy.coordinator", f"no coordinator named {name!r}; registered: {hint}")])
    return _REGISTRY[name]


def accepts_resume(fn: Coordinator) -> bool:
    """Whether ``fn`` takes a ``resume`` keyword (by name or through ``**kwargs``)."""
    sig = keywords(fn)
    return sig is not None and (sig[1] or "resume" in sig[0])


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Call the job's coordinator while this process holds the job's run folder."""
    from ..training.rundir import RunFolder

    fn = coordinator(job)
    # A coordinator receives a plain JSON copy: it cannot mutate the frozen job.
    config = json.loads(json.dumps(getattr(job.strategy, "config", None)))
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare()
        summary = fn(job, config, resume=resume) if accepts_resume(fn) else fn(job, config)
    if not isinstance(summary, dict):
        raise TypeError(f"coordinator {job.strategy.coordinator!r} must return a dict summary "
                        f"(got {type(summary).__name__})")
    return summary


def _ignores(job: JobConfig, *, resume: bool = False, probe: bool = True) -> Effective:
    """``--resume`` for a coordinator that takes no ``resume`` keyword (it runs fresh)."""
    fn = _REGISTRY.get(str(getattr(job.strategy, "coordinator", "")))
    if not resume or fn is None or accepts_resume(fn):
        return Effective(settings={})
    name = getattr(job.strategy, "coordinator", None)
    return Effective(settings={"resume": False}, ignored=[Ignored(
        "--resume", f"coordinator {name!r} takes no 'resume' keyword, so it cannot resume; "
                    "add '*, resume: bool = False' to its signature")])


# The coordinator runs in this process (it may start processes of its own); it receives
# the whole job, [task] included, so any task is its to train.
SPEC = ExecutorSpec(name="Custom", run=run, ignores=_ignores)
