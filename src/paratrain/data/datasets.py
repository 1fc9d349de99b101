"""Datasets by name (``digits``, ``diabetes``: scikit-learn's bundled sets; nothing
downloads) and users' ``factory="module:function"`` returning a :class:`DataBundle` or
``(X, y)`` arrays, split here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..config import ConfigError
from ..config.job import DataSpec
from .split import digits_arrays, shuffle_split, stratified_split


@dataclass(frozen=True)
class DataBundle:
    """Train and test sets (float32 features, int64 labels; a regression set's targets are
    float32 ``[n, k]`` and ``num_classes`` is ``k``) plus their shapes."""

    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]


def split_arrays(x: Any, y: Any, *, test_fraction: float, seed: int) -> DataBundle:
    """Stratified (unless a label has one row), seeded split: ``train_test_split``'s (:mod:`.split`)."""
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
