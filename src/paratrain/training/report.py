"""``report.png``: the loss and the task's own metrics (accuracy; perplexity and bits per
token; mse and r2) as metrics.jsonl records them (matplotlib, Agg), and the provenance map of a run summary (which figures were measured, which modelled).

Where it is drawn. matplotlib's import is most of the plot's cost (about 0.45 s of CPU,
then 0.25 s to draw). A run imports it ahead of the end: in a background thread as the run
starts (:func:`import_in_background`), or -- the ``paratrain`` command's own Local run --
in a drawer process started with the command (:func:`start_drawer`), which imports it on
the core the command's single-threaded start-up leaves idle and draws ``report.png`` when
asked (:func:`draw_report`) while the run writes its model and summary. Either way the file
is the same, drawn by the same code (:func:`plot_curves`), and a failure warns and never
raises (:func:`never_fails`); a drawer that cannot start or dies leaves the plot to this
process."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .rundir import read_metrics

__all__ = ["plot_curves", "curves_figure", "panels", "never_fails", "provenance", "import_in_background",
           "start_drawer", "draw_report", "Drawing", "MEASURED", "MODELLED", "CONFIGURED"]

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
    import is left for :func:`plot_curves` to report. With a drawer process running
    (:func:`start_drawer`) the thread imports nothing: the drawer draws."""
    target = _quiet(_import_matplotlib) if _drawer["proc"] is None else (lambda: None)
    thread = threading.Thread(target=target, name="paratrain-matplotlib", daemon=True)
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
    records = [r for r in read_metrics(run_dir, train=True) if x_key in r]
    spec = panels(records) or [("loss", [])]  # a run with no records yet: one empty loss panel
    # the training curve (every run.log_every steps) draws train_loss where the run has one,
    # rather than the evaluation records' mean since the previous evaluation
    curve = [r for r in records if r.get("kind") == "train"]
    ncols = min(len(spec), 3)
    nrows = math.ceil(len(spec) / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4 * nrows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax, (metric, keys) in zip(axes, spec, strict=False):
        for key in keys:
            pts = [(r[x_key], r[key]) for r in (curve if key == "train_loss" and curve else records)
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


def _draw(run_dir: str | Path, x_key: str, title: str | None) -> Path:
    fig = curves_figure(run_dir, x_key=x_key, title=title)
    import matplotlib.pyplot as plt

    out = Path(run_dir) / "report.png"
    try:
        # tight_layout leaves a placeholder layout engine, for which savefig lays the
        # figure out once more in a draw of its own; the layout is done (same file, 40 ms less)
        fig.set_layout_engine(None)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


@never_fails
def plot_curves(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Path:
    """``run_dir/report.png``: the loss and every evaluation metric the run's
    ``metrics.jsonl`` records (:func:`panels`) against ``x_key``.

    Failures warn (see :func:`never_fails`) and return None."""
    return _draw(run_dir, x_key, title)


# -- the drawer process ----------------------------------------------------------------

_drawer: dict[str, Any] = {"proc": None}
_DRAW_TIMEOUT_S = 300.0  # a drawer that has not answered by then is stopped; this process draws


def start_drawer() -> bool:
    """Start the drawer process (``python -m paratrain.training.drawer``), which imports
    matplotlib at once and then waits for :func:`draw_report`. For a process that runs one
    Local run and exits (the ``paratrain`` command): called before torch is imported, the
    import runs on the core the command's start-up leaves idle. The drawer ignores SIGINT
    (this process handles Ctrl-C), ends when this process closes its stdin or exits, and is
    reaped at exit. False when it could not be started (the plot is then drawn here)."""
    if _drawer["proc"] is not None:
        return True
    import atexit

    src = str(Path(__file__).resolve().parents[2])  # the folder holding paratrain
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "paratrain.training.drawer"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, process_group=0)
    except (OSError, ValueError):
        return False
    _drawer["proc"] = proc
    atexit.register(_stop_drawer)
    return True


def _stop_drawer() -> None:
    proc = _drawer["proc"]
    if proc is None:
        return
    _drawer["proc"] = None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError):
        proc.stdout.close()


class Drawing:
    """``report.png`` being drawn (:func:`draw_report`); :meth:`wait` returns its path, or
    None when drawing failed (warned, as :func:`plot_curves` warns)."""

    def __init__(self, run_dir: str | Path, x_key: str, title: str | None, proc: Any) -> None:
        self.run_dir, self.x_key, self.title, self.proc = run_dir, x_key, title, proc

    def wait(self) -> Path | None:
        proc, self.proc = self.proc, None
        if proc is None:  # no drawer: drawn here, now
            return plot_curves(self.run_dir, x_key=self.x_key, title=self.title)
        reply = _read_reply(proc)
        _stop_drawer()
        if reply is None:  # the drawer died or hung: drawn here
            return plot_curves(self.run_dir, x_key=self.x_key, title=self.title)
        if "error" in reply:
            warnings.warn(f"paratrain: could not draw the report plot (plot_curves): {reply['error']}",
                          RuntimeWarning, stacklevel=2)
            return None
        return Path(reply["path"])


def _read_reply(proc: Any) -> dict[str, Any] | None:
    deadline = time.monotonic() + _DRAW_TIMEOUT_S
    fd = proc.stdout.fileno()
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
    try:
        reply = json.loads(data)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) and ("path" in reply or "error" in reply) else None


def draw_report(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Drawing:
    """Start drawing ``run_dir/report.png`` (as :func:`plot_curves`, from the run's
    ``metrics.jsonl``, which must be complete): by the drawer process when one runs
    (:func:`start_drawer`; it draws while this process goes on), else here when
    :meth:`Drawing.wait` is called."""
    proc = _drawer["proc"]
    if proc is not None:
        request = json.dumps({"run_dir": str(run_dir), "x_key": x_key, "title": title}) + "\n"
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
        except (OSError, ValueError):
            _stop_drawer()
            proc = None
    return Drawing(run_dir, x_key, title, proc)


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
