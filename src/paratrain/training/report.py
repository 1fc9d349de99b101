"""``report.png``: loss and accuracy curves from metrics.jsonl (matplotlib, Agg), and the
provenance map of a run summary (which figures were measured, which modelled)."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .rundir import read_metrics

__all__ = ["plot_curves", "never_fails", "provenance", "import_in_background", "MEASURED", "MODELLED",
           "CONFIGURED"]

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


def _import_matplotlib() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def import_in_background() -> threading.Thread:
    """Import matplotlib (about 0.5 s of CPU, most of ``report.png``'s cost) in a daemon
    thread, so that the plot at the end of a run does not wait for it: called when a run
    starts, it overlaps the import with the data loading and the first steps (torch's
    kernels release the GIL; a run's one intra-op thread leaves a core for it). Python's
    import lock makes :func:`plot_curves` wait for an import still in progress; a failed
    import is left for :func:`plot_curves` to report."""
    thread = threading.Thread(target=_quiet(_import_matplotlib), name="paratrain-matplotlib", daemon=True)
    thread.start()
    return thread


def _quiet(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(Exception):
            fn()
    return run


@never_fails
def plot_curves(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Path:
    """Plot every record carrying ``train_loss``/``test_loss``/``test_accuracy`` against ``x_key``.

    Failures warn (see :func:`never_fails`) and return None."""
    _import_matplotlib()
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


MEASURED, MODELLED, CONFIGURED = "measured", "modelled", "configured"
_SUFFIXES = {"_measured": MEASURED, "_modelled": MODELLED}


def _is_figure(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    if isinstance(v, Mapping):
        return any(_is_figure(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(_is_figure(x) for x in v)
    return False


def provenance(summary: Mapping[str, Any], *, modelled: Iterable[str] = (),
               configured: Iterable[str] = ()) -> dict[str, str]:
    """``{key: "measured" | "modelled" | "configured"}`` for every top-level figure of ``summary``.

    A key ending in ``_measured`` / ``_modelled`` says it itself; keys named in ``modelled``
    come from a formula (a cost model, a theory bound); keys in ``configured`` echo the job
    file (sizes it asked for). Every other numeric field (or container of numbers) is
    something the run counted or timed: measured. Strings, booleans and ``None`` are not
    figures and get no entry. A key whose suffix contradicts the list it is in is a
    ValueError."""
    mod, conf = set(modelled), set(configured)
    out: dict[str, str] = {}
    for k, v in summary.items():
        if k == "provenance":
            continue
        suffix = next((lab for suf, lab in _SUFFIXES.items() if k.endswith(suf)), None)
        if k in mod or k in conf:
            listed = MODELLED if k in mod else CONFIGURED
            if suffix is not None and suffix != listed:
                raise ValueError(f"summary key {k!r} is named {suffix} but listed as {listed}")
            out[k] = listed
        elif suffix is not None:
            out[k] = suffix
        elif _is_figure(v):
            out[k] = MEASURED
    return out
