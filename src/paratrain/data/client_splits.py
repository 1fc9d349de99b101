"""Per-client test splits and feature-shifted clients, for personalised federated evaluation.

A client's test split follows its training partition: each class's test examples dealt in
proportion to the clients' training examples of it (``iid``: a seeded permutation;
``speaker``: the client holding the speaker); disjoint and covering, so summed evaluation
sums score every example once. Feature shift ``a`` (FedBN, Li et al. 2021): client ``c``'s
inputs become ``exp(u_c) * x + o_c``, ``u_c, o_c ~ U(-a, a)`` seeded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .partition import partition_labels

IndexList = list[np.ndarray]


def owners(parts: IndexList, n: int) -> np.ndarray:
    """The client of each of ``n`` examples (``-1``: none)."""
    out = np.full(n, -1, dtype=np.int64)
    for c, idx in enumerate(parts):
        out[np.asarray(idx, dtype=np.int64)] = c
    return out


def _proportional(counts: np.ndarray, m: int) -> np.ndarray:
    """``m`` items split in proportion to ``counts`` (largest remainder, ties to the lower index)."""
    quota = counts / counts.sum() * m
    base: np.ndarray = np.floor(quota).astype(np.int64)
    rest = m - int(base.sum())
    order = np.lexsort((np.arange(len(counts)), -(quota - base)))
    base[order[:rest]] += 1
    return base


def client_test_splits(train: Any, test: Any, parts: IndexList, method: str, *, seed: int) -> IndexList:
    """Each client's test example indices (sorted int64), following ``parts`` (see above)."""
    k = len(parts)
    n_test = len(test)
    rng = np.random.default_rng([int(seed), 0x7E57])
    if method == "iid":
        return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(n_test), k)]
    y_train = partition_labels(train, method)
    y_test = partition_labels(test, method)
    own = owners(parts, len(y_train))
    buckets: list[list[np.ndarray]] = [[] for _ in range(k)]
    if method == "speaker":
        holder = {int(s): int(c) for s, c in zip(y_train, own, strict=True) if c >= 0}
        unseen = sorted({int(s) for s in y_test} - holder.keys())
        for j, s in enumerate(rng.permutation(np.array(unseen, dtype=np.int64))):
            holder[int(s)] = j % k
        owner = np.array([holder[int(s)] for s in y_test], dtype=np.int64)
        return [np.flatnonzero(owner == c).astype(np.int64) for c in range(k)]
    for label in np.unique(y_test):
        idx = np.flatnonzero(y_test == label)
        idx = idx[rng.permutation(len(idx))]
        counts = np.bincount(own[(y_train == label) & (own >= 0)], minlength=k).astype(np.float64)
        sizes = _proportional(counts if counts.sum() > 0 else np.ones(k), len(idx))
        for c, chunk in enumerate(np.split(idx, np.cumsum(sizes)[:-1])):
            buckets[c].append(chunk)
    return [np.sort(np.concatenate(b)).astype(np.int64) if b else np.zeros(0, dtype=np.int64)
            for b in buckets]


def feature_shifts(num_clients: int, amount: float, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scales, offsets)`` per client: ``exp(U(-a, a))`` and ``U(-a, a)``, seeded."""
    rng = np.random.default_rng([int(seed), 0xFEA7])
    a = float(amount)
    return np.exp(rng.uniform(-a, a, num_clients)), rng.uniform(-a, a, num_clients)


def shift_features(dataset: Any, owner: np.ndarray, scales: np.ndarray, offsets: np.ndarray) -> TensorDataset:
    """A copy of ``dataset`` with example ``i``'s inputs ``s_c * x + o_c``, ``c = owner[i]``
    (none: unchanged); ValueError unless its inputs are floating-point tensors."""
    tensors = getattr(dataset, "tensors", None)
    if not isinstance(tensors, tuple) or not tensors or not tensors[0].is_floating_point():
        raise ValueError("feature_shift scales and offsets the inputs: it needs a dataset of "
                         "(float features, ...) tensors, e.g. data.name = 'digits'")
    x = tensors[0]
    ok = owner >= 0
    shape = (-1,) + (1,) * (x.dim() - 1)
    s = torch.ones(len(x), dtype=x.dtype)
    o = torch.zeros(len(x), dtype=x.dtype)
    s[torch.from_numpy(ok)] = torch.from_numpy(scales[owner[ok]]).to(x.dtype)
    o[torch.from_numpy(ok)] = torch.from_numpy(offsets[owner[ok]]).to(x.dtype)
    return TensorDataset(x * s.reshape(shape) + o.reshape(shape), *tensors[1:])


def client_datasets(train: Any, test: Any, parts: IndexList, spec: Any, *, seed: int,
                    ) -> tuple[Any, Any, IndexList]:
    """``(train, test, test_splits)`` of the clients, shifted per client with ``feature_shift``."""
    splits = client_test_splits(train, test, parts, str(getattr(spec, "method", "iid")), seed=seed)
    amount = float(getattr(spec, "feature_shift", 0.0) or 0.0)
    if amount > 0:
        scales, offsets = feature_shifts(len(parts), amount, seed=seed)
        train = shift_features(train, owners(parts, len(train)), scales, offsets)
        test = shift_features(test, owners(splits, len(test)), scales, offsets)
    return train, test, splits
