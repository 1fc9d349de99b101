"""``report.png`` of a PBT run: one panel for every member's fitness per generation and one
per hyperparameter (log axis for ``log_uniform``, ``choice`` values by index). Exploit copies
are dotted segments from donor to recipient, failed members crosses, the best final member's
ancestry black.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...config.job import ChoiceDim, LogUniformDim
from ...training.report import never_fails
from .pbt import ancestry, best_of


def _numeric(dim: Any, value: Any) -> float:
    if isinstance(dim, ChoiceDim):
        return float(dim.values.index(value)) if value in dim.values else math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


@never_fails
def plot_population(
    lineage_file: str | Path, out: str | Path, *, space: Mapping[str, Any], title: str | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    doc = json.loads(Path(lineage_file).read_text(encoding="utf-8"))
    history: list[dict[str, Any]] = doc["generations"]
    n = int(doc["population_size"])
    names = sorted(space)
    panels = 1 + len(names)
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    gens = [r["generation"] for r in history]
    cmap = plt.get_cmap("tab10" if n <= 10 else "viridis")
    colour = [cmap(i % 10 if n <= 10 else i / max(n - 1, 1)) for i in range(n)]
    best = best_of(history[-1]["fitness"], doc.get("mode", "max")) if history else None
    trace = ancestry(history, best) if best is not None else []

    def series(ax: Any, values: list[list[float]], label: str, log: bool = False) -> None:
        for i in range(n):
            ax.plot(gens, [v[i] for v in values], color=colour[i], marker=".", lw=1, alpha=0.8,
                    label=f"member {i}" if n <= 10 else None)
        for r, nxt in zip(history, history[1:], strict=False):
            for c in r["copies"]:
                d, rec = c["donor"], c["recipient"]
                ys = [values[r["generation"]][d], values[nxt["generation"]][rec]]
                ax.plot([r["generation"], nxt["generation"]], ys, ls=":", color="grey", lw=0.8)
        if trace:
            ax.plot([t["generation"] for t in trace],
                    [values[t["generation"]][t["member"]] for t in trace],
                    color="black", lw=2, label="best ancestry")
        ax.set_xlabel("generation")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")

    fit = [[math.nan if f is None else float(f) for f in r["fitness"]] for r in history]
    series(flat[0], fit, f"fitness ({doc.get('metric', 'fitness')})")
    failed = [(r["generation"], i) for r in history for i, f in enumerate(r["fitness"]) if f is None]
    if failed:  # no fitness to draw: mark failed members along the bottom edge
        low = flat[0].get_ylim()[0]
        flat[0].scatter([g for g, _ in failed], [low] * len(failed), marker="x", clip_on=False,
                        color=[colour[i] for _, i in failed], label="failed", zorder=3)
    flat[0].legend(fontsize=7)
    for ax, name in zip(flat[1:], names, strict=False):
        dim = space[name]
        vals = [[_numeric(dim, h[name]) for h in r["hparams"]] for r in history]
        series(ax, vals, name, log=isinstance(dim, LogUniformDim))
        if isinstance(dim, ChoiceDim):
            ax.set_yticks(range(len(dim.values)), [str(v) for v in dim.values])
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle(title or Path(out).parent.name)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
