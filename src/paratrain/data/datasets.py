"""Datasets: ``digits`` (scikit-learn's bundled 8x8 digits; nothing downloads).

A user factory ``factory="module:function"`` is called with ``seed=`` and the section's
extra keys and returns a :class:`DataBundle` or ``(X, y)`` arrays, which are split here.
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

__all__ = ["DataBundle", "DATASETS", "load_data", "split_arrays"]


@dataclass(frozen=True)
class DataBundle:
    """Train and test sets (float32 features, int64 labels) plus their shapes."""

    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]


def split_arrays(x: Any, y: Any, *, test_fraction: float, seed: int) -> DataBundle:
    """Stratified, seeded train/test split of arrays into a DataBundle."""
    from sklearn.model_selection import train_test_split

    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y)
    if x.ndim < 2 or len(x) != len(y):
        raise ConfigError([("data", f"features of shape {x.shape} do not match {len(y)} labels")])
    classes, y_idx = np.unique(y, return_inverse=True)
    counts = np.bincount(y_idx)
    stratify = y_idx if counts.min() >= 2 else None
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y_idx, test_size=test_fraction, random_state=seed, stratify=stratify
    )
    return DataBundle(
        train=TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr).long()),
        test=TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te).long()),
        num_classes=len(classes),
        input_shape=tuple(x.shape[1:]),
    )


def digits(*, seed: int, test_fraction: float = 0.25) -> DataBundle:
    """1,797 8x8 digit images from scikit-learn, pixel values scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return split_arrays(d.data / 16.0, d.target, test_fraction=test_fraction, seed=seed)


DATASETS: dict[str, Callable[..., DataBundle]] = {"digits": digits}


def load_data(spec: DataSpec, *, seed: int) -> DataBundle:
    """Load the dataset a job names; errors name the ``data`` field."""
    if spec.factory is not None:
        from ..models.zoo import import_object

        fn = import_object(spec.factory, field="data.factory")
        try:
            out = fn(seed=seed, **spec.kwargs)
        except TypeError as e:
            raise ConfigError([("data", f"factory {spec.factory!r} rejected its arguments: {e}")]) from None
        if isinstance(out, DataBundle):
            return out
        if isinstance(out, tuple) and len(out) == 2:
            return split_arrays(out[0], out[1], test_fraction=spec.test_fraction, seed=seed)
        raise ConfigError([("data.factory", "must return a DataBundle or an (X, y) pair")])
    if spec.name not in DATASETS:
        raise ConfigError([("data.name", f"unknown dataset {spec.name!r}; valid: {', '.join(DATASETS)}")])
    try:
        return DATASETS[spec.name](seed=seed, test_fraction=spec.test_fraction, **spec.kwargs)
    except TypeError as e:
        raise ConfigError([("data", f"{spec.name!r} rejected its arguments: {e}")]) from None
