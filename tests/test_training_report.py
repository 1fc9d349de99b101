"""paratrain.training.report: matplotlib, most of report.png's cost, can be imported in a
background thread when a run starts; the plot at the end then finds it imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import json, sys
from pathlib import Path
from paratrain.training import report
run = Path(sys.argv[1])
run.mkdir(parents=True, exist_ok=True)
(run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_loss": 1.0 / s, "test_loss": 2.0 / s,
                                                       "test_accuracy": 0.1 * s}) + "\n" for s in (1, 2, 3)))
print("before", "matplotlib.pyplot" in sys.modules)
thread = report.import_in_background()
thread.join(timeout=120)
print("after", "matplotlib.pyplot" in sys.modules, thread.name)
print("plot", report.plot_curves(run) == run / "report.png")
"""


def test_matplotlib_imports_in_the_background_and_the_plot_uses_it(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["before False", "after True paratrain-matplotlib", "plot True"]
    assert (tmp_path / "run" / "report.png").stat().st_size > 1000
