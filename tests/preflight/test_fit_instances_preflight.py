"""Issue 20 item 6: ``paratrain.fit`` with an ``nn.Module``, DataBundle or Task instance
makes the same pre-run checks as a job file's run (paratrain.preflight), on the objects
themselves, and warns about the same ignored settings: a bad setting is the same
ConfigError naming the same field, raised before the run folder is written."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paratrain
from paratrain.config import ConfigError
from paratrain.config.effective import IgnoredSettingWarning
from paratrain.task import ClassificationTask


def _digits_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))  # digits: 64 -> 10


def _job(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    return {"run": {"name": "fit", "output_dir": str(tmp_path), "device": "cpu"},
            "model": {"name": "mlp", "hidden": [16]}, "train": {"epochs": 1, "max_steps": 2},
            **sections}


def _problems(tmp_path: Path, doc: dict[str, Any], **instances: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        paratrain.fit(doc, **instances)
    assert not (tmp_path / "fit").exists()  # nothing written before every check passed
    return list(e.value.problems)


BAD_SETTINGS = {
    "unknown optimizer option": {"train": {"epochs": 1, "optimizer": {"name": "sgd", "lr": 0.1, "foo": 1}}},
    "optimizer value": {"train": {"epochs": 1, "optimizer": {"name": "sgd", "lr": 0.1, "nesterov": True}}},
    "plugin import": {"run": {"name": "fit", "imports": ["no_such_module_for_paratrain"]}},
    "subgraph path": {"subgraphs": {"blok": {"type": "Local"}}},
}


@pytest.mark.parametrize("bad", list(BAD_SETTINGS), ids=list(BAD_SETTINGS))
def test_a_bad_setting_with_a_module_instance_is_the_job_files_error(tmp_path: Path, bad: str) -> None:
    doc = _job(tmp_path)
    for key, value in BAD_SETTINGS[bad].items():
        doc[key] = {**doc.get(key, {}), **value}
    from_spec = _problems(tmp_path, doc)
    from_instance = _problems(tmp_path, doc, model=_digits_net())
    fields = [f for f, _ in from_instance]
    assert [f for f, _ in from_spec] == fields, (from_spec, from_instance)
    if bad != "subgraph path":  # the suggestions list the modules of each model
        assert from_spec == from_instance


def test_an_instance_model_that_fails_on_the_data_is_refused_before_the_run(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _job(tmp_path), model=nn.Linear(3, 10))
    assert problems[0][0] == "model" and "two training examples" in problems[0][1], problems


class _NanTask(ClassificationTask):
    """Classification whose loss is NaN: a Task instance the checks must catch."""

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        return super().loss(output, batch) * math.nan


def test_a_task_instance_gets_the_task_checks(tmp_path: Path) -> None:
    doc = _job(tmp_path)
    task = _NanTask(paratrain.config.job.load_job(doc).data)
    problems = _problems(tmp_path, doc, task=task)
    assert problems == [("model", "the task's loss on two training examples is nan")]


def test_instances_are_warned_about_ignored_settings_and_still_train(tmp_path: Path) -> None:
    net = _digits_net()
    with pytest.warns(IgnoredSettingWarning, match="compression"):
        summary = paratrain.fit(_job(tmp_path, compression={"method": "TopK", "k": 8}), model=net)
    assert summary["steps"] == 2 and net.training  # the checks left the instance in train mode
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        paratrain.fit(_job(tmp_path), model=_digits_net(), overwrite=True)
