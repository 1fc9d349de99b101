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


def _lines(ax: object) -> list[str]:
    return [str(line.get_label()) for line in ax.get_lines()]  # type: ignore[attr-defined]


def _fit(tmp: Path, name: str, **sections: object) -> Path:
    from paratrain.config import load_job
    from paratrain.dispatch import execute

    execute(load_job({"run": {"name": name, "seed": 0, "output_dir": str(tmp)}, **sections}))
    return tmp / name


def test_report_plots_the_metrics_a_language_model_and_a_classifier_record(tmp_path: Path) -> None:
    """report.png has one panel per metric the run's metrics.jsonl holds: a language model's
    loss, perplexity and bits per token (no accuracy panel, which it would leave empty); a
    classifier's loss and accuracy."""
    import matplotlib.pyplot as plt

    from paratrain.training.report import curves_figure

    lm = _fit(tmp_path, "lm", task={"name": "language_model", "block_size": 16},
              model={"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
              data={"name": "shakespeare"},
              train={"epochs": 1, "max_steps": 4, "batch_size": 8, "eval_every": 2,
                     "optimizer": {"name": "adamw", "lr": 3e-3}})
    clf = _fit(tmp_path, "clf", model={"name": "mlp", "hidden": [16]},
               train={"epochs": 1, "max_steps": 20, "batch_size": 16, "eval_every": 10,
                      "optimizer": {"name": "sgd", "lr": 0.1}})
    for run, want in ((lm, {"loss": ["train_loss", "test_loss"], "perplexity": ["test_perplexity"],
                            "bits_per_token": ["test_bits_per_token"]}),
                      (clf, {"loss": ["train_loss", "test_loss"], "accuracy": ["test_accuracy"]})):
        assert (run / "report.png").stat().st_size > 1000
        fig = curves_figure(run)
        try:
            got = {ax.get_title(): _lines(ax) for ax in fig.axes}
            assert got == want, got
            for ax in fig.axes:
                assert ax.get_ylabel() == ax.get_title()
                for line in ax.get_lines():  # 2 evaluations; the training curve at every step
                    steps = 2 if line.get_label() != "train_loss" else (4 if run == lm else 20)
                    assert len(line.get_xdata()) == steps, line.get_label()
        finally:
            plt.close(fig)


def test_panels_follow_the_keys_records_hold() -> None:
    """Regression's mse and r2; a federated round's personal metrics beside the global one;
    keys without a number (or not metrics) make no panel."""
    from paratrain.training.report import panels

    assert panels([{"step": 1, "train_loss": 1.0, "test_loss": 1.0, "test_mse": 1.0, "test_r2": 0.5,
                    "time_s": 3.0, "test_note": "x", "test_ok": True}]) == [
        ("loss", ["train_loss", "test_loss"]), ("mse", ["test_mse"]), ("r2", ["test_r2"])]
    assert panels([{"round": 0, "test_loss": 2.0, "test_accuracy": 0.5, "personal_test_accuracy": 0.6,
                    "personal_test_accuracy_min": 0.2, "clients_ok": 4}]) == [
        ("loss", ["test_loss"]),
        ("accuracy", ["test_accuracy", "personal_test_accuracy", "personal_test_accuracy_min"])]
    assert panels([{"step": 1, "test_perplexity": None}]) == []


_DRAWER_SCRIPT = r"""
import json, sys, warnings
from pathlib import Path
from paratrain.training import report

root = Path(sys.argv[1])
records = "".join(json.dumps({"step": s, "train_loss": 1.0 / s, "test_loss": 2.0 / s,
                              "test_perplexity": 3.0 / s}) + "\n" for s in (1, 2, 3))
here, there, bad, dead = (root / k / "run" for k in ("here", "there", "bad", "dead"))
for run in (here, there, bad, dead):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(records)
(bad / "report.png").mkdir()  # savefig cannot write over a folder
out = {"matplotlib_here": None}
assert report.start_drawer()
drawing = report.draw_report(there, title="t")
out["path"] = str(drawing.wait())
out["drawer_left"] = report._drawer["proc"] is not None
out["same_png"] = (report.plot_curves(here, title="t").read_bytes() == (there / "report.png").read_bytes())
messages = []
for run, drawer in ((bad, True), (bad, False)):
    if drawer:
        report.start_drawer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = report.draw_report(run).wait()
    messages.append([str(w.message) for w in caught] + [result])
out["messages"] = messages
report.start_drawer()
report._drawer["proc"].kill()  # a drawer that died: this process draws
report._drawer["proc"].wait()
out["fallback"] = str(report.draw_report(dead).wait())
print(json.dumps(out))
"""


def test_the_drawer_process_draws_the_same_report_and_fails_as_the_plot_does(tmp_path: Path) -> None:
    """report.start_drawer / draw_report (the paratrain command's Local run): the drawer's
    report.png is byte for byte the one plot_curves draws here; a failure is the same warning
    (and None); a drawer that died leaves the plot to this process; none is left running."""
    import json

    out = subprocess.run([sys.executable, "-c", _DRAWER_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["path"] == str(tmp_path / "there" / "run" / "report.png")
    assert r["same_png"] and not r["drawer_left"]
    via_drawer, here = r["messages"]
    assert via_drawer == here and here[-1] is None, r["messages"]
    assert "could not draw the report plot (plot_curves): IsADirectoryError" in here[0]
    assert r["fallback"] == str(tmp_path / "dead" / "run" / "report.png")


_LOCAL_JOB = """
[run]
name = "lm"
output_dir = "{out}"
[task]
name = "language_model"
block_size = 16
[model]
name = "gpt"
n_layer = 1
n_head = 2
n_embd = 16
[data]
name = "shakespeare"
[train]
epochs = 1
max_steps = 3
batch_size = 8
optimizer = {{ name = "adamw", lr = 3e-3 }}
"""


def test_the_commands_local_run_draws_through_its_drawer_and_leaves_no_process(tmp_path: Path) -> None:
    """`paratrain run` (its own process) on a Local job: report.png is drawn by the drawer
    process, the same file the run draws in process (paratrain.fit, main(argv)), and no
    process of the command's session is left when it returns."""
    from test_cli_waits_for_processes import _alive_in_session

    from paratrain.cli import main

    job = tmp_path / "lm.toml"
    job.write_text(_LOCAL_JOB.format(out=tmp_path / "cmd"))
    log = tmp_path / "cli.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "paratrain.cli", "run", str(job), "-q"],
                                cwd=tmp_path, start_new_session=True, stdout=f, stderr=f)
        code = proc.wait(timeout=300)
    left = _alive_in_session(proc.pid)
    assert code == 0, log.read_text()
    assert left == [], left
    here = tmp_path / "here.toml"
    here.write_text(_LOCAL_JOB.format(out=tmp_path / "here"))
    assert main(["run", str(here), "-q"]) == 0
    assert (tmp_path / "cmd" / "lm" / "report.png").read_bytes() == (tmp_path / "here" / "lm" / "report.png").read_bytes()
    assert "report plot" not in log.read_text()
