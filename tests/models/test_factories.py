"""Issue 21 items 6 and 7: a factory gets the documented keywords its signature takes (any
subset; all with ``**kwargs``), and what it requires but is not given -- or a section key it
does not take -- is a ConfigError naming the factory and the keyword; ``block_size`` and
``stride`` under ``[data]`` work for the language-model task (or, set in both sections, the
error says they belong in ``[task]``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.models.zoo import call_factory
from paratrain.preflight import preflight
from paratrain.task import resolve_task

SEEN: list[dict[str, Any]] = []


def only_classes(num_classes: int) -> nn.Module:
    SEEN.append({"num_classes": num_classes})
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))


def nothing() -> nn.Module:
    SEEN.append({})
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def everything(**kw: Any) -> nn.Module:
    SEEN.append(kw)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, kw["num_classes"]))


def needs_width(input_shape: tuple[int, ...], width: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], width))


def task_of_size(size: int) -> Any:
    raise AssertionError("never called without its size")


def arrays() -> tuple[np.ndarray, np.ndarray]:  # a data factory without seed=
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 64)).astype(np.float32), rng.integers(0, 10, 64)


def test_a_factory_gets_the_documented_keywords_it_takes() -> None:
    SEEN.clear()
    for ref in ("only_classes", "nothing", "everything"):
        preflight(load_job({"model": {"factory": f"test_factories:{ref}"}}), warn=False)
    assert SEEN == [{"num_classes": 10}, {}, {"input_shape": (64,), "num_classes": 10}]
    preflight(load_job({"data": {"factory": "test_factories:arrays"}}), warn=False)


def test_a_missing_or_unexpected_keyword_names_the_factory_and_the_keyword() -> None:
    with pytest.raises(ConfigError) as e:
        preflight(load_job({"model": {"factory": "test_factories:needs_width"}}), warn=False)
    (field, msg), = e.value.problems
    assert field == "model.factory" and "'test_factories:needs_width'" in msg and "'width'" in msg, msg
    assert "input_shape" in msg and "num_classes" in msg  # what a model factory is offered
    with pytest.raises(ConfigError) as e:
        call_factory(nothing, "test_factories:nothing", field="model.factory", offered={},
                     kwargs={"depth": 2})
    assert e.value.problems == [("model.factory", "factory 'test_factories:nothing' takes no "
                                                  "keyword 'depth' (it takes: none)")]
    with pytest.raises(ConfigError) as e:
        resolve_task(load_job({"task": {"factory": "test_factories:task_of_size"}}))
    assert e.value.problems[0][0] == "task.factory" and "requires 'size'" in e.value.problems[0][1]


LM = {"task": {"name": "language_model"}, "model": {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16}}


def test_block_size_under_data_is_the_tasks() -> None:
    job = load_job({**LM, "data": {"name": "shakespeare", "block_size": 16, "stride": 8}})
    train, _ = resolve_task(job).datasets(0)
    x, y = train[0]
    assert x.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert torch.equal(train[1][0][:8], x[8:])  # stride 8
    preflight(job, warn=False)
    clash = load_job({**LM, "task": {"name": "language_model", "block_size": 32},
                      "data": {"name": "shakespeare", "block_size": 16}})
    with pytest.raises(ConfigError) as e:
        preflight(clash, warn=False)
    assert e.value.problems[0][0] == "data.block_size" and "belongs in [task]" in e.value.problems[0][1]
