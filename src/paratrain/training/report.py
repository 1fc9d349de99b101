"""``report.png``: loss and accuracy curves from metrics.jsonl (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from .rundir import read_metrics

__all__ = ["plot_curves"]


def plot_curves(run_dir: str | Path, *, x_key: str = "step", title: str | None = None) -> Path:
    """Plot every record carrying ``train_loss``/``test_loss``/``test_accuracy`` against ``x_key``."""
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
    ax_loss.legend()
    ax_acc.set_xlabel(x_key)
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend()
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
