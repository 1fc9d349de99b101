"""``report.png``: loss and accuracy curves from metrics.jsonl (matplotlib, Agg)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from .rundir import read_metrics

__all__ = ["plot_curves", "never_fails"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def never_fails(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """A plot is a by-product of a finished run: if drawing it fails (matplotlib missing,
    a full disk, odd metrics) warn once naming the cause and return None, never raise and
    never stay silent."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported as a warning, the run stands
            warnings.warn(f"paratrain: could not draw the report plot ({fn.__name__}): "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            return None

    return wrapper


@never_fails
def plot_curves(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Path:
    """Plot every record carrying ``train_loss``/``test_loss``/``test_accuracy`` against ``x_key``.

    Failures warn (see :func:`never_fails`) and return None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = [r for r in read_metrics(run_dir) if x_key in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in (("train_loss", ax_loss), ("test_loss", ax_loss), ("test_accuracy", ax_acc)):
        pts = [(r[x_key], r[key]) for r in records if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=key, marker="." if len(pts) < 50 else None)
    ax_loss.set_xlabel(x_key)
    ax_loss.set_ylabel("loss")
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend()
    ax_acc.set_xlabel(x_key)
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    if ax_acc.get_legend_handles_labels()[0]:
        ax_acc.legend()
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
