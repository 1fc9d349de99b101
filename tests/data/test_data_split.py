"""paratrain's train/test splits and its digits reader equal scikit-learn's, row for row
(:mod:`paratrain.data.datasets` does not import scikit-learn; these tests do, as the reference):
``train_test_split(x, y, test_size=f, random_state=seed, stratify=y or None)`` over seeds,
fractions, label counts and mixes (ties in the per-class shares included), and
``load_digits()``'s arrays; sizes that leave a side empty, or a stratified side with fewer rows
than labels, are ConfigErrors naming ``data.test_fraction``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.config import ConfigError
from paratrain.data.datasets import digits_arrays, shuffle_split, stratified_split


def _reference(n: int, y: np.ndarray | None, f: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split  # here: 1.5 s to import, not at collection

    rows = np.arange(n)
    train, test = train_test_split(rows, test_size=f, random_state=seed, stratify=y)
    return train, test


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(2, 40), min_size=1, max_size=12), f=st.floats(0.05, 0.6),
       seed=st.integers(0, 2**31 - 1), shuffle_labels=st.booleans())
def test_stratified_split_equals_scikit_learn(counts: list[int], f: float, seed: int, shuffle_labels: bool) -> None:
    y = np.repeat(np.arange(len(counts)), counts)
    if shuffle_labels:
        y = np.random.RandomState(seed % 1000).permutation(y)
    try:
        want = _reference(len(y), y, f, seed)
    except ValueError:  # scikit-learn refuses (a side smaller than the label count, or empty)
        with pytest.raises(ConfigError):
            stratified_split(y, test_fraction=f, seed=seed)
        return
    got = stratified_split(y, test_fraction=f, seed=seed)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 500), f=st.floats(0.01, 0.99), seed=st.integers(0, 2**31 - 1))
def test_shuffle_split_equals_scikit_learn(n: int, f: float, seed: int) -> None:
    try:
        want = _reference(n, None, f, seed)
    except ValueError:
        with pytest.raises(ConfigError):
            shuffle_split(n, test_fraction=f, seed=seed)
        return
    got = shuffle_split(n, test_fraction=f, seed=seed)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_ties_in_the_shares_are_broken_as_scikit_learn_breaks_them() -> None:
    # ten equal classes, 25 % test: every class's share has the same remainder (non-vacuity:
    # the random tie-breaking decides which classes get the extra rows)
    y = np.repeat(np.arange(10), 7)
    for seed in range(20):
        got, want = stratified_split(y, test_fraction=0.25, seed=seed), _reference(len(y), y, 0.25, seed)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert len({tuple(stratified_split(y, test_fraction=0.25, seed=s)[1][:5]) for s in range(5)}) > 1


def test_digits_are_scikit_learns() -> None:
    from sklearn.datasets import load_digits

    x, y = digits_arrays()
    d = load_digits()
    assert x.dtype == d.data.dtype and np.array_equal(x, d.data) and np.array_equal(y, d.target)
    assert x.shape == (1797, 64)


def test_sizes_that_leave_nothing_are_named() -> None:
    with pytest.raises(ConfigError, match="data.test_fraction"):
        shuffle_split(3, test_fraction=0.9, seed=0)
    with pytest.raises(ConfigError, match="data.test_fraction"):
        stratified_split(np.repeat(np.arange(5), 2), test_fraction=0.2, seed=0)  # 2 test rows, 5 labels
    with pytest.raises(ConfigError, match="data.test_fraction"):
        shuffle_split(10, test_fraction=1.5, seed=0)
