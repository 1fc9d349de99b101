"""``report.png``: the loss and the task's own metrics (accuracy; perplexity and bits per
token; mse and r2) as metrics.jsonl records them (matplotlib, Agg), and the provenance map of a run summary (which figures were measured, which modelled)."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .rundir import read_metrics

__all__ = ["plot_curves", "curves_figure", "panels", "never_fails", "provenance", "import_in_background", "MEASURED", "MODELLED",
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


_TEST = re.compile(r"^(?:personal_)?test_(?P<metric>.+?)(?:_min)?$")
# metrics that are fractions (plotted on [0, 1]) and those spanning decades (log scale)
_FRACTIONS = frozenset({"accuracy"})
_LOG_SCALE = frozenset({"perplexity"})


def panels(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of ``report.png`` as ``(title, keys)``, from the keys the records carry:
    ``loss`` (``train_loss``, ``test_loss``) first, then one panel per other evaluation
    metric the task logged, in the order they first appear -- ``test_<m>`` with a federated
    run's ``personal_test_<m>`` (mean over clients) and ``personal_test_<m>_min`` beside it:
    ``accuracy`` for classification, ``perplexity`` and ``bits_per_token`` for a language
    model, ``mse`` and ``r2`` for regression. A key that holds no number is left out, so no
    panel is empty (``loss`` included: without a loss there is no loss panel)."""
    out: dict[str, list[str]] = {}
    for r in records:
        for key, value in r.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            m = _TEST.match(key)
            if key != "train_loss" and m is None:
                continue
            metric = "loss" if m is None else m.group("metric")
            keys = out.setdefault(metric, [])
            if key not in keys:
                keys.append(key)
    order = ["loss"] if "loss" in out else []
    order += [m for m in out if m != "loss"]
    return [(m, out[m]) for m in order]


def curves_figure(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Any:
    """The figure of ``report.png`` (a matplotlib Figure; the caller closes it): one panel
    per :func:`panels` entry, each key of the panel one curve against ``x_key``."""
    _import_matplotlib()
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = [r for r in read_metrics(run_dir) if x_key in r]
    spec = panels(records) or [("loss", [])]  # a run with no records yet: one empty loss panel
    ncols = min(len(spec), 3)
    nrows = math.ceil(len(spec) / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4 * nrows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax, (metric, keys) in zip(axes, spec, strict=False):
        for key in keys:
            pts = [(r[x_key], r[key]) for r in records
                   if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=key, marker="." if len(pts) < 50 else None)
        ax.set_title(metric)
        ax.set_xlabel(x_key)
        ax.set_ylabel(metric)
        if metric in _FRACTIONS:
            ax.set_ylim(0, 1)
        elif metric in _LOG_SCALE and keys:
            ax.set_yscale("log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for ax in axes[len(spec):]:
        fig.delaxes(ax)
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    return fig


@never_fails
def plot_curves(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Path:
    """``run_dir/report.png``: the loss and every evaluation metric the run's
    ``metrics.jsonl`` records (:func:`panels`) against ``x_key``.

    Failures warn (see :func:`never_fails`) and return None."""
    fig = curves_figure(run_dir, x_key=x_key, title=title)
    import matplotlib.pyplot as plt

    out = Path(run_dir) / "report.png"
    try:
        fig.savefig(out, dpi=100)
    finally:
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
