"""A job's plugins: :func:`import_plugins` imports what its ``run.imports`` lists (models,
datasets, tasks, coordinators register themselves there), in the launching process and in
every worker (:mod:`.entry`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..config import ConfigError

# Plugin files this process imported, by module name -> resolved path: a later job may
# load another file of the same name (each test's tmp folder) over one of these, never
# over any other module.
_PLUGIN_FILES: dict[str, Path] = {}


def import_plugins(refs: list[str], *, base: Path | None = None) -> None:
    """Import each ``run.imports`` entry: a module name or a ``.py`` path (relative to
    ``base``, the job file's folder, exported as ``PARATRAIN_JOB_DIR`` for the workers).

    A ``.py`` file is importable by its module name afterwards (``my_models.py`` makes
    ``model.factory = "my_models:build"`` work without PYTHONPATH), unless that name is
    already another module's (it is then only ``paratrain_plugin_<stem>``). Like ``import``,
    a file already imported from the same path is not run again. Any error the plugin's own
    code raises (or a path the system refuses) is a ConfigError naming ``run.imports[i]``."""
    if base is not None:
        os.environ["PARATRAIN_JOB_DIR"] = str(Path(base).resolve())
    for i, ref in enumerate(refs):
        field = f"run.imports[{i}]"
        try:
            if ref.endswith(".py"):
                _import_file(ref, base, field)
            else:
                try:
                    importlib.import_module(ref)
                except ImportError as e:
                    raise ConfigError([(field, f"cannot import {ref!r}: {e}")]) from None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the job's own code: one line, no traceback
            raise ConfigError([(field, _plugin_failure(ref, e))]) from None


def keywords(fn: Any, skip: Iterable[str] = ()) -> tuple[list[str], bool] | None:
    """The keywords ``fn`` takes (in order, less ``skip``) and whether it takes ``**kwargs``;
    None when it has no signature to read (a builtin or C callable)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in skip]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _import_file(ref: str, base: Path | None, field: str) -> None:
    path = Path(ref)
    if not path.is_absolute() and base is not None:
        path = base / path
    if not path.is_file():
        raise ConfigError([(field, f"no such file {str(path)!r}")])
    path = path.resolve()
    alias = f"paratrain_plugin_{path.stem}"
    loaded = sys.modules.get(alias)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return  # imported once already (validate, then preflight): like `import`
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
    except Exception as e:  # noqa: BLE001 - the job's own code (a ConfigError it raises too)
        for name in names:
            sys.modules.pop(name, None)
        raise ConfigError([(field, _plugin_failure(str(path), e))]) from None
    if len(names) > 1:
        _PLUGIN_FILES[path.stem] = path


def _plugin_failure(what: str, e: BaseException) -> str:
    line = (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
    return f"importing {what!r} failed: {line}"
