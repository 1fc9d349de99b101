"""Seeded train/test splits and scikit-learn's bundled digits without importing scikit-learn
(``sklearn.model_selection`` pulls in SciPy: 1.6 s of CPU in every process). The splits are
``train_test_split(test_size=f, random_state=seed, stratify=...)``'s, index for index
(tests/data/test_data_split.py): ``n_test = ceil(f * n)``; stratified per-class counts are
the approximate mode of the multivariate hypergeometric (:func:`_approximate_mode`).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError


def split_sizes(n: int, test_fraction: float) -> tuple[int, int]:
    """``(n_train, n_test)`` for ``n`` rows; ConfigError when a side would be empty."""
    f = float(test_fraction)
    if not 0.0 < f < 1.0:
        raise ConfigError([("data.test_fraction", f"must be in (0, 1) (got {test_fraction!r})")])
    n_test = math.ceil(f * n)
    n_train = n - n_test
    if n_train <= 0:
        raise ConfigError([("data.test_fraction", (
            f"{n} rows with test_fraction {f:g} leave no training row ({n_test} test rows)"))])
    return n_train, n_test


def shuffle_split(n: int, *, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` row indices of an unstratified seeded split (module docstring)."""
    n_train, n_test = split_sizes(n, test_fraction)
    perm = np.random.RandomState(seed).permutation(n)
    return perm[n_test:n_test + n_train], perm[:n_test]


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``draws`` each class gets: the floor of its proportional share, then one
    more for the classes with the largest remainders until ``draws`` are placed (a random
    choice among tied remainders)."""
    share = counts / counts.sum() * draws
    out = np.floor(share)
    missing = int(draws - out.sum())
    if missing > 0:
        rest = share - out
        for value in np.sort(np.unique(rest))[::-1]:
            (tied,) = np.where(rest == value)
            take = min(len(tied), missing)
            out[rng.choice(tied, size=take, replace=False)] += 1
            missing -= take
            if missing == 0:
                break
    result: np.ndarray = out.astype(int)
    return result


def stratified_split(y: Any, *, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` row indices keeping each label's share on both sides (ConfigError: too few)."""
    y = np.asarray(y)
    n_train, n_test = split_sizes(len(y), test_fraction)
    classes, codes, counts = np.unique(y, return_inverse=True, return_counts=True)
    k = len(classes)
    if counts.min() < 2:
        raise ConfigError([("data", f"a stratified split needs two rows of every label; "
                                    f"{classes[counts < 2].tolist()} have one")])
    for side, size in (("training", n_train), ("test", n_test)):
        if size < k:
            raise ConfigError([("data.test_fraction", (
                f"the {side} split would have {size} rows for {k} labels: a stratified split needs "
                f"at least one row of each label on each side"))])
    rows_of = np.split(np.argsort(codes, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    train_n = _approximate_mode(counts, n_train, rng)
    test_n = _approximate_mode(counts - train_n, n_test, rng)
    train: list[Any] = []
    test: list[Any] = []
    for i in range(k):
        rows = rows_of[i].take(rng.permutation(counts[i]), mode="clip")
        train.extend(rows[:train_n[i]])
        test.extend(rows[train_n[i]:train_n[i] + test_n[i]])
    return rng.permutation(train), rng.permutation(test)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits ``[1797, 64]`` (0..16) and labels, read as ``load_digits`` does."""
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(r) / "datasets" / "data" / "digits.csv.gz" for r in roots
                 if (Path(r) / "datasets" / "data" / "digits.csv.gz").is_file()), None)
    if path is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        return np.asarray(d.data), np.asarray(d.target)
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)
