"""Custom: user coordinators registered by name (``@register_coordinator("name")``).

A coordinator is ``fn(job: JobConfig, config: JSON) -> dict`` (the summary). It receives
the whole job, so every section (``[task]``, ``[compression]``, ``[tensor_parallel]``,
``[train]``, ``[federated]``, ...) is the coordinator's to use: any task runs under Custom
(preflight checks that the task builds, as for every strategy). One that declares a ``resume`` keyword
(``fn(job, config, *, resume=False)``, or ``**kwargs``) is told about ``--resume``; one
without it is called as before (and ``--resume`` is reported as ignored). A job whose
strategy is ``{"type":"Custom","coordinator":name,"config":...}`` runs it; modules listed
in ``run.imports`` are imported first so their decorators register. An unknown name is
an error listing the registered ones; there is no fallback to Local.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.effective import Effective, Ignored
from ..config.job import JobConfig
from .spec import ExecutorSpec

__all__ = ["SPEC", "register_coordinator", "registered_coordinators", "coordinator",
           "accepts_resume", "import_plugins", "run"]

Coordinator = Callable[..., dict[str, Any]]
_REGISTRY: dict[str, Coordinator] = {}


def register_coordinator(name: str) -> Callable[[Coordinator], Coordinator]:
    """Decorator registering ``fn`` as the coordinator called ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"coordinator name must be a non-empty string (got {name!r})")

    def deco(fn: Coordinator) -> Coordinator:
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_coordinators() -> list[str]:
    return sorted(_REGISTRY)


def coordinator(name: str) -> Coordinator | None:
    """The coordinator registered as ``name`` (None if there is none)."""
    return _REGISTRY.get(name)


def accepts_resume(fn: Coordinator) -> bool:
    """Whether ``fn`` takes a ``resume`` keyword (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "resume" and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                               inspect.Parameter.POSITIONAL_OR_KEYWORD))
        for p in params
    )


# Plugin files this process imported, by module name -> resolved path: a later job may
# load another file of the same name (each test's tmp folder) over one of these, never
# over any other module.
_PLUGIN_FILES: dict[str, Path] = {}

JOB_DIR_ENV = "PARATRAIN_JOB_DIR"


def import_plugins(refs: list[str], *, base: Path | None = None) -> None:
    """Import each ``run.imports`` entry: a module name or a ``.py`` path (relative to
    ``base``, the job file's folder).

    A ``.py`` file is importable by its module name afterwards (``my_models.py`` makes
    ``model.factory = "my_models:build"`` work without PYTHONPATH), unless that name is
    already another module's (it is then only ``paratrain_plugin_<stem>``). ``base`` is
    exported as ``PARATRAIN_JOB_DIR`` so that worker processes resolve the same files.
    Like ``import``, a file already imported from the same path is not run again.
    Any error the plugin's own code raises is a ConfigError naming ``run.imports[i]``."""
    if base is not None:
        os.environ[JOB_DIR_ENV] = str(Path(base).resolve())
    for i, ref in enumerate(refs):
        field = f"run.imports[{i}]"
        if ref.endswith(".py"):
            path = Path(ref)
            if not path.is_absolute() and base is not None:
                path = base / path
            if not path.is_file():
                raise ConfigError([(field, f"no such file {str(path)!r}")])
            path = path.resolve()
            alias = f"paratrain_plugin_{path.stem}"
            loaded = sys.modules.get(alias)
            if loaded is not None and getattr(loaded, "__file__", None) == str(path):
                continue  # imported once already (validate, then preflight): like `import`
            spec = importlib.util.spec_from_file_location(alias, path)
            if spec is None or spec.loader is None:
                raise ConfigError([(field, f"cannot import {str(path)!r}")])
            module = importlib.util.module_from_spec(spec)
            names = [alias]
            current = sys.modules.get(path.stem)
            if path.stem.isidentifier() and (current is None or path.stem in _PLUGIN_FILES):
                names.append(path.stem)
            for name in names:
                sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - the job's own code: one line, no traceback
                for name in names:
                    sys.modules.pop(name, None)
                raise ConfigError([(field, _plugin_failure(str(path), e))]) from None
            if len(names) > 1:
                _PLUGIN_FILES[path.stem] = path
        else:
            try:
                importlib.import_module(ref)
            except ImportError as e:
                raise ConfigError([(field, f"cannot import {ref!r}: {e}")]) from None
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001
                raise ConfigError([(field, _plugin_failure(ref, e))]) from None


def _plugin_failure(what: str, e: BaseException) -> str:
    line = (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
    return f"importing {what!r} failed: {line}"


def run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Call the job's coordinator while this process holds the job's run folder (a
    fresh run clears it first, only with ``overwrite`` if it holds a previous run)."""
    from ..training.rundir import RunFolder

    name = getattr(job.strategy, "coordinator", None)
    if name not in _REGISTRY:
        known = ", ".join(registered_coordinators()) or "none registered"
        raise ConfigError(
            [("strategy.coordinator", f"no coordinator named {name!r}; registered: {known}")]
        )
    # A coordinator receives a plain JSON copy: it cannot mutate the frozen job.
    config = json.loads(json.dumps(getattr(job.strategy, "config", None)))
    fn = _REGISTRY[name]
    with RunFolder(job, resume=resume, overwrite=overwrite) as folder:
        folder.prepare()
        summary = fn(job, config, resume=resume) if accepts_resume(fn) else fn(job, config)
    if not isinstance(summary, dict):
        raise TypeError(f"coordinator {name!r} must return a dict summary (got {type(summary).__name__})")
    return summary


def _ignores(job: JobConfig, *, resume: bool = False, probe: bool = True) -> Effective:
    """``--resume`` for a coordinator that takes no ``resume`` keyword (it runs fresh)."""
    fn = coordinator(str(getattr(job.strategy, "coordinator", "")))
    if not resume or fn is None or accepts_resume(fn):
        return Effective(settings={})
    name = getattr(job.strategy, "coordinator", None)
    return Effective(settings={"resume": False}, ignored=[Ignored(
        "--resume", f"coordinator {name!r} takes no 'resume' keyword, so it cannot resume; "
                    "add '*, resume: bool = False' to its signature")])


# The coordinator runs in this process (it may start processes of its own); it receives
# the whole job, [task] included, so any task is its to train.
SPEC = ExecutorSpec(name="Custom", run=run, ignores=_ignores)
