"""Issue 20 item 6: a Custom coordinator receives the whole job, so it runs with any
``[task]`` (a built-in such as the language model, or a task factory): ``validate`` and
``run`` accept the job, and the coordinator can resolve and train the job's task."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

import paratrain
from paratrain.cli import main
from paratrain.config.job import JobConfig
from paratrain.executors import register_coordinator
from paratrain.task import evaluate, resolve_task

SEEN: list[tuple[str, dict[str, float]]] = []


@register_coordinator("custom-task-eval")
def _evaluate_the_task(job: JobConfig, config: Any) -> dict[str, Any]:
    """Build the job's task and model and evaluate it once (what a coordinator may do)."""
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    model = task.build_model(job.model, train)
    metrics = evaluate(model, task, test)
    SEEN.append((type(task).__name__, metrics))
    return {"strategy": "Custom", "task": type(task).__name__, **metrics}


CUSTOM = {"type": "Custom", "coordinator": "custom-task-eval", "config": {}}
LM = {"task": {"name": "language_model", "block_size": 16},
      "data": {"factory": "test_tp_task:tiny_lm_data"},
      "model": {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16}}
FACTORY = {"task": {"factory": "user_task:make_task", "hidden": 8}}


@pytest.mark.parametrize("doc", [LM, FACTORY], ids=["language_model", "task_factory"])
def test_custom_runs_a_non_default_task(tmp_path: Path, doc: dict[str, Any]) -> None:
    SEEN.clear()
    summary = paratrain.fit({**doc, "run": {"name": "c", "output_dir": str(tmp_path)},
                             "strategy": CUSTOM})
    want = "LanguageModelTask" if doc is LM else "SineTask"
    assert summary["task"] == want and [name for name, _ in SEEN] == [want]
    assert summary == {"strategy": "Custom", "task": want, **SEEN[0][1]}


def test_validate_accepts_custom_with_a_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plugin = tmp_path / "coord.py"
    plugin.write_text(textwrap.dedent("""
        from paratrain.executors import register_coordinator

        @register_coordinator("custom-task-file")
        def coordinate(job, config):
            return {"strategy": "Custom"}
    """))
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent("""
        [run]
        imports = ["coord.py"]

        [task]
        factory = "user_task:make_task"

        [strategy]
        type = "Custom"
        coordinator = "custom-task-file"
        config = {}
    """))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert f"{path}: ok" in capsys.readouterr().out
