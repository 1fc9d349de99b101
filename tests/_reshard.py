"""A run through ``paratrain.fit`` that also returns the reshard warnings it gave
(tests/training/test_training_reshard*.py)."""

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
    run), or, for a launched run, what its summary's ``resumed_from`` says (and its rank 0's
    warning on stderr)."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = paratrain.fit(doc, **kw)
    err = capfd.readouterr().err
    LAST_STDERR[0] = err
    here = [f"{ReshardWarning.__name__}: {w.message}" for w in caught
            if issubclass(w.category, ReshardWarning)]
    # a launched run's rank 0 warns on its own stderr; its summary says the same
    resumed = summary.get("resumed_from") or {}
    told = ([f"resumed {resumed['checkpoint']} (layout {resumed['layout']}) on layout {resumed['onto']}: "
             "by names; reset: "
             f"{'; '.join(resumed['reset'])}"] if resumed.get("resharded") else [])
    return summary, here + told + [line for line in err.splitlines() if ReshardWarning.__name__ in line]
