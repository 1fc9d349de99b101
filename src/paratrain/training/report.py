"""``report.png`` (matplotlib, Agg) from metrics.jsonl, and a summary's provenance map.
matplotlib's import is most of the plot's cost (0.45 s of CPU), so a run imports it in a
background thread or, for the ``paratrain`` command's Local run, in a drawer process that
draws while the run writes its model. A failure warns, never raises.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .rundir import read_metrics

log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def never_fails(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """A plot is a by-product: a failure to draw it warns naming the cause and returns None."""

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
    """Import matplotlib in a daemon thread as a run starts (nothing with a drawer process);
    a failure is met again, and warned, by :func:`plot_curves`."""
    drawer = _drawer["proc"] is not None

    def run() -> None:
        try:
            if not drawer:
                _import_matplotlib()
        except Exception as e:  # noqa: BLE001 - plot_curves meets it again and warns
            log.debug("background import of matplotlib failed: %r", e)

    thread = threading.Thread(target=run, name="paratrain-matplotlib", daemon=True)
    thread.start()
    return thread


_TEST = re.compile(r"^(?:personal_)?test_(?P<metric>.+?)(?:_min)?$")
# metrics that are fractions (plotted on [0, 1]) and those spanning decades (log scale)
_FRACTIONS = frozenset({"accuracy"})
_LOG_SCALE = frozenset({"perplexity"})


def panels(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of ``report.png`` as ``(title, keys)``: ``loss`` first, then one per other
    evaluation metric in the order they first appear (``test_<m>``, with a federated run's
    ``personal_test_<m>`` and ``personal_test_<m>_min`` beside it). No panel is empty."""
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
    """The figure of ``report.png`` (the caller closes it): each :func:`panels` key against ``x_key``."""
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
    """``run_dir/report.png`` from the run's ``metrics.jsonl`` (failures warn, return None)."""
    return _draw(run_dir, x_key, title)


# -- the drawer process ----------------------------------------------------------------

_drawer: dict[str, Any] = {"proc": None}
_DRAW_TIMEOUT_S = 300.0  # a drawer that has not answered by then is stopped; this process draws


def start_drawer() -> bool:
    """Start the drawer process (:func:`_drawer_main`), which imports matplotlib at once on the
    core the command's start-up leaves idle, then waits for :func:`draw_report`. False when
    it could not be started (the plot is then drawn here)."""
    if _drawer["proc"] is not None:
        return True
    import atexit

    src = str(Path(__file__).resolve().parents[2])  # the folder holding paratrain
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "paratrain.training.report"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, process_group=0)
    except (OSError, ValueError) as e:
        log.debug("no drawer process (the plot is drawn in this one): %r", e)
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
    """``report.png`` being drawn; :meth:`wait` returns its path (None: failed, warned)."""

    def __init__(self, run_dir: str | Path, x_key: str, title: str | None, proc: Any) -> None:
        self.run_dir, self.x_key, self.title, self.proc = run_dir, x_key, title, proc

    def wait(self) -> Path | None:
        proc, self.proc = self.proc, None
        if proc is None:  # no drawer: drawn here, now
            return plot_curves(self.run_dir, x_key=self.x_key, title=self.title)
        reply = _read_reply(proc)
        _stop_drawer()
        if reply is None:
            log.debug("the drawer process died or hung: the plot is drawn here")
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


def _drawer_main() -> None:
    """The drawer process: imports matplotlib, then answers each JSON request line on stdin
    (``run_dir``, ``x_key``, ``title``) with ``{"path"}`` or ``{"error"}`` on stdout, until
    its input ends. SIGINT is the run's; other output goes to stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever a library prints goes where this process's errors go
    sys.stdout = sys.stderr
    try:
        _import_matplotlib()
    except Exception as e:  # noqa: BLE001 - met again, and answered, at the request
        log.debug("importing matplotlib failed: %r", e)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            path = _draw(req["run_dir"], str(req.get("x_key") or "step"), req.get("title"))
            answer = {"path": str(path)}
        except Exception as e:  # noqa: BLE001 - the run warns with it
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def draw_report(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Drawing:
    """Start drawing ``run_dir/report.png`` from the complete ``metrics.jsonl``: by the
    drawer process when one runs, else here at :meth:`Drawing.wait`."""
    proc = _drawer["proc"]
    if proc is not None:
        request = json.dumps({"run_dir": str(run_dir), "x_key": x_key, "title": title}) + "\n"
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
        except (OSError, ValueError) as e:
            log.debug("the drawer process is gone (the plot is drawn here): %r", e)
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

    A key ending in ``_measured`` / ``_modelled`` says it itself; ``modelled`` keys come
    from a formula, ``configured`` ones echo the job file; every other number (or container
    of numbers) was measured. A suffix contradicting its list is a ValueError."""
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


if __name__ == "__main__":
    _drawer_main()
