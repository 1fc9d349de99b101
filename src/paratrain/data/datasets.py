"""Datasets by name (``digits``, ``diabetes``: scikit-learn's bundled sets; nothing
downloads) and users' ``factory="module:function"`` returning a :class:`DataBundle` or
``(X, y)`` arrays, split here without importing scikit-learn (``sklearn.model_selection``
pulls in SciPy: 1.6 s of CPU in every process). The splits are ``train_test_split(test_size=f,
random_state=seed, stratify=...)``'s, index for index (tests/data/test_data_split.py):
``n_test = ceil(f * n)``; stratified per-class counts are the approximate mode of the
multivariate hypergeometric (:func:`_approximate_mode`).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..config import ConfigError
from ..config.job import DataSpec


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


@dataclass(frozen=True)
class DataBundle:
    """Train and test sets (float32 features, int64 labels; a regression set's targets are
    float32 ``[n, k]`` and ``num_classes`` is ``k``) plus their shapes."""

    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]


def split_arrays(x: Any, y: Any, *, test_fraction: float, seed: int) -> DataBundle:
    """Stratified (unless a label has one row), seeded split: ``train_test_split``'s (module docstring)."""
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y)
    if x.ndim < 2 or len(x) != len(y):
        raise ConfigError([("data", f"features of shape {x.shape} do not match {len(y)} labels")])
    classes, y_idx = np.unique(y, return_inverse=True)
    counts = np.bincount(y_idx)
    if counts.min() >= 2:
        tr, te = stratified_split(y_idx, test_fraction=test_fraction, seed=seed)
    else:
        tr, te = shuffle_split(len(y_idx), test_fraction=test_fraction, seed=seed)
    x_tr, x_te, y_tr, y_te = x[tr], x[te], y_idx[tr], y_idx[te]
    return DataBundle(
        train=TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr).long()),
        test=TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te).long()),
        num_classes=len(classes),
        input_shape=tuple(x.shape[1:]),
    )


def digits(*, seed: int, test_fraction: float = 0.25) -> DataBundle:
    """1,797 8x8 digit images from scikit-learn, pixel values scaled to [0, 1]."""
    data, target = digits_arrays()
    return split_arrays(data / 16.0, target, test_fraction=test_fraction, seed=seed)


def split_regression(x: Any, y: Any, *, test_fraction: float, seed: int,
                     standardize: bool = False) -> DataBundle:
    """Seeded split of real-valued targets; ``standardize`` by the *training* mean and std."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    y = y.reshape(len(y), -1) if y.ndim != 2 else y
    if x.ndim < 2 or len(x) != len(y):
        raise ConfigError([("data", f"features of shape {x.shape} do not match {len(y)} targets")])
    tr, te = shuffle_split(len(y), test_fraction=test_fraction, seed=seed)
    x_tr, x_te, y_tr, y_te = x[tr], x[te], y[tr], y[te]
    if standardize:
        mx, sx = x_tr.mean(0), x_tr.std(0)
        my, sy = y_tr.mean(0), y_tr.std(0)
        sx[sx == 0], sy[sy == 0] = 1.0, 1.0
        x_tr, x_te = (x_tr - mx) / sx, (x_te - mx) / sx
        y_tr, y_te = (y_tr - my) / sy, (y_te - my) / sy

    def ds(a: np.ndarray, b: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(a.astype(np.float32)), torch.from_numpy(b.astype(np.float32)))

    return DataBundle(train=ds(x_tr, y_tr), test=ds(x_te, y_te), num_classes=y.shape[1],
                      input_shape=tuple(x.shape[1:]))


def diabetes(*, seed: int, test_fraction: float = 0.25) -> DataBundle:
    """scikit-learn's diabetes set (442 x 10), standardised by the training split."""
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    return split_regression(d.data, d.target, test_fraction=test_fraction, seed=seed,
                            standardize=True)


DATASETS: dict[str, Callable[..., DataBundle]] = {"digits": digits, "diabetes": diabetes}
# built-in datasets whose targets are real values (task.name = "regression")
REGRESSION_DATASETS = frozenset({"diabetes"})
# built-in text corpora (task.name = "language_model"; paratrain.data.shakespeare)
CORPORA = frozenset({"shakespeare", "tokens"})  # tokens: a token file (paratrain.data.tokens)


def load_data(spec: DataSpec, *, seed: int, regression: bool = False) -> DataBundle:
    """Load the dataset a job names (``regression``: a factory's ``(X, y)`` has real targets)."""
    if spec.factory is not None:
        from ..models.zoo import call_factory, import_object

        fn = import_object(spec.factory, field="data.factory")
        out = call_factory(fn, spec.factory, field="data.factory", offered={"seed": seed},
                           kwargs=spec.kwargs)
        if isinstance(out, DataBundle):
            return out
        if isinstance(out, tuple) and len(out) == 2:
            split = split_regression if regression else split_arrays
            return split(out[0], out[1], test_fraction=spec.test_fraction, seed=seed)
        raise ConfigError([("data.factory", "must return a DataBundle or an (X, y) pair")])
    if spec.name in CORPORA:
        raise ConfigError([("data.name", f"{spec.name!r} is a text corpus for task.name = "
                                         "'language_model' (set it in [task])")])
    if spec.name not in DATASETS:
        raise ConfigError([("data.name", f"unknown dataset {spec.name!r}; valid: "
                                         f"{', '.join([*DATASETS, *sorted(CORPORA)])}")])
    try:
        return DATASETS[spec.name](seed=seed, test_fraction=spec.test_fraction, **spec.kwargs)
    except TypeError as e:
        raise ConfigError([("data", f"{spec.name!r} rejected its arguments: {e}")]) from None
