"""A run through ``paratrain.fit`` that also returns the reshard warnings it gave
(tests/test_training_reshard*.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import paratrain
from paratrain.training.reshard import ReshardWarning

# the whole stderr of the last run, for an assertion's message when a warning is missing
LAST_STDERR: list[str] = [""]


def fit_noting_reshards(doc: dict[str, Any], capfd: pytest.CaptureFixture[str], **kw: Any) -> tuple[dict[str, Any], list[str]]:
    """The summary and the ReshardWarning messages: warned in this process (a one-process
    run) or by a worker of rank 0 (on its stderr)."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = paratrain.fit(doc, **kw)
    err = capfd.readouterr().err
    LAST_STDERR[0] = err
    here = [f"{ReshardWarning.__name__}: {w.message}" for w in caught
            if issubclass(w.category, ReshardWarning)]
    return summary, here + [line for line in err.splitlines() if ReshardWarning.__name__ in line]
