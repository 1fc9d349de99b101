"""The experiment trackers ``run.loggers`` may name, and the library each one needs."""

from __future__ import annotations

import importlib.util

__all__ = ["LOGGERS", "check_loggers"]

# logger name -> (the module it imports, the paratrain extra that installs it)
LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


def check_loggers(names: list[str]) -> None:
    """ValueError for an unknown or repeated logger, or one whose library is not installed
    (naming the extra that installs it)."""
    for i, name in enumerate(names):
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}; the loggers are "
                             f"{', '.join(repr(n) for n in LOGGERS)}")
        if name in names[:i]:
            raise ValueError(f"logger {name!r} is listed twice")
        module, extra = LOGGERS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"logger {name!r} needs the {module} library, which is not "
                             f"installed: pip install 'paratrain[{extra}]'")
