"""Federated partitioners and per-client test splits. A partition is ``num_clients`` sorted
int64 index arrays, disjoint and covering every example once, a pure function of ``(labels,
num_clients, parameters, seed)``: ``iid`` (a seeded permutation cut into near-equal parts),
``shards`` (McMahan et al. 2017: label-sorted shards, ``shards_per_client`` random ones each),
``dirichlet`` (Hsu et al. 2019: each class split by ``p_k ~ Dir(α·1_N)``, then a ``min_size``
top-up from the largest client) and ``speaker`` (LEAF Shakespeare: the speakers, seeded order,
round-robin). A client's test split follows its training partition: each class's test
examples dealt in proportion to the clients' training examples of it (``iid``: a seeded
permutation; ``speaker``: the client holding the speaker). Feature shift ``a`` (FedBN, Li et
al. 2021): client ``c``'s inputs become ``exp(u_c) * x + o_c``, ``u_c, o_c ~ U(-a, a)`` seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

IndexList = list[np.ndarray]


def _labels(labels: Any) -> np.ndarray:
    arr = np.asarray(labels.numpy() if hasattr(labels, "numpy") else labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be one-dimensional (got shape {arr.shape})")
    return arr


def _check(n: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1 (got {num_clients})")
    if num_clients > n:
        raise ValueError(f"cannot split {n} examples among {num_clients} clients (more clients than examples)")


def _finish(parts: Sequence[np.ndarray]) -> IndexList:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition_iid(num_examples: int, num_clients: int, *, seed: int) -> IndexList:
    """A seeded permutation of ``range(num_examples)`` cut into near-equal parts."""
    _check(num_examples, num_clients)
    rng = np.random.default_rng([int(seed), 0x11D])
    perm = rng.permutation(num_examples)
    return _finish(np.array_split(perm, num_clients))


def partition_shards(
    labels: Any, num_clients: int, *, shards_per_client: int, seed: int
) -> IndexList:
    """Label-sorted shards, ``shards_per_client`` random shards per client."""
    y = _labels(labels)
    n = len(y)
    _check(n, num_clients)
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1 (got {shards_per_client})")
    num_shards = num_clients * shards_per_client
    if num_shards > n:
        raise ValueError(
            f"data.partition.shards_per_client: {num_clients} clients x {shards_per_client} "
            f"shards = {num_shards} shards > {n} examples"
        )
    rng = np.random.default_rng([int(seed), 0x5A4D])
    # shuffled first, so that ties within a label are broken at random
    perm = rng.permutation(n)
    order = perm[np.argsort(y[perm], kind="stable")]
    shards = np.array_split(order, num_shards)
    assign = rng.permutation(num_shards)
    parts = [
        np.concatenate([shards[s] for s in assign[c * shards_per_client : (c + 1) * shards_per_client]])
        for c in range(num_clients)
    ]
    return _finish(parts)


def partition_dirichlet(
    labels: Any, num_clients: int, *, alpha: float, min_size: int = 0, seed: int
) -> IndexList:
    """Per-class Dirichlet(α) proportions over clients, then a ``min_size`` top-up."""
    y = _labels(labels)
    n = len(y)
    _check(n, num_clients)
    if not alpha > 0:
        raise ValueError(f"data.partition.alpha must be > 0 (got {alpha})")
    if min_size * num_clients > n:
        raise ValueError(
            f"data.partition.min_size: {num_clients} clients x min_size {min_size} = "
            f"{min_size * num_clients} > {n} examples"
        )
    rng = np.random.default_rng([int(seed), 0xD1E1])
    buckets: list[list[int]] = [[] for _ in range(num_clients)]
    for k in np.unique(y):
        idx = np.flatnonzero(y == k)
        idx = idx[rng.permutation(len(idx))]
        p = rng.dirichlet(np.full(num_clients, float(alpha)))
        cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
        for c, chunk in enumerate(np.split(idx, cuts)):
            buckets[c].extend(int(i) for i in chunk)
    sizes = np.array([len(b) for b in buckets])
    while sizes.min() < min_size:
        small = int(np.argmin(sizes))  # lowest index among the smallest
        big = int(np.argmax(sizes))
        j = int(rng.integers(len(buckets[big])))
        buckets[big][j], buckets[big][-1] = buckets[big][-1], buckets[big][j]
        buckets[small].append(buckets[big].pop())
        sizes[small] += 1
        sizes[big] -= 1
    return _finish([np.array(b, dtype=np.int64) for b in buckets])


def partition_speaker(speakers: Any, num_clients: int, *, seed: int) -> IndexList:
    """Whole speaking roles per client: the distinct speakers in a seeded order, round-robin."""
    sp = _labels(speakers)
    _check(len(sp), num_clients)
    roles, inverse = np.unique(sp, return_inverse=True)
    if num_clients > len(roles):
        raise ValueError(f"data.partition.method 'speaker': {num_clients} clients but only "
                         f"{len(roles)} speakers have examples")
    rng = np.random.default_rng([int(seed), 0x5BEA])
    client_of_role = np.empty(len(roles), dtype=np.int64)
    client_of_role[rng.permutation(len(roles))] = np.arange(len(roles)) % num_clients
    owner = client_of_role[inverse]
    return _finish([np.flatnonzero(owner == c) for c in range(num_clients)])


def partition_indices(labels: Any, num_clients: int, spec: Any, *, seed: int) -> IndexList:
    """Dispatch on a ``PartitionSpec``'s ``method`` (``speaker``: ``labels`` are speaker ids)."""
    y = _labels(labels)
    method = getattr(spec, "method", "iid")
    if method == "iid":
        return partition_iid(len(y), num_clients, seed=seed)
    if method == "shards":
        return partition_shards(y, num_clients, shards_per_client=spec.shards_per_client, seed=seed)
    if method == "dirichlet":
        return partition_dirichlet(
            y, num_clients, alpha=spec.alpha, min_size=spec.min_size, seed=seed
        )
    if method == "speaker":
        return partition_speaker(y, num_clients, seed=seed)
    raise ValueError(f"unknown data.partition.method {method!r}; valid: iid, shards, dirichlet, speaker")


def partition_labels(dataset: Any, method: str) -> np.ndarray:
    """What ``method`` splits ``dataset`` by (see the module docstring), one per example."""
    if method == "speaker":
        speakers = getattr(dataset, "speakers", None)
        if speakers is None:
            raise ValueError("method 'speaker' splits a corpus by speaking role: the training "
                             "set has no speakers (use data.name = 'shakespeare')")
        sp = _labels(speakers)
        if len(sp) != len(dataset):
            raise ValueError(f"method 'speaker': {len(sp)} speakers for {len(dataset)} examples")
        return sp
    if method in ("shards", "dirichlet"):
        tensors = getattr(dataset, "tensors", None)
        y = tensors[1] if isinstance(tensors, tuple) and len(tensors) >= 2 else None
        if y is None or y.dim() != 1 or y.is_floating_point():
            raise ValueError(f"method {method!r} splits by class label: it needs a training set "
                             "of (features, integer labels); use 'iid' for this task")
        return _labels(y)
    return np.zeros(len(dataset), dtype=np.int64)  # iid: only the count matters


def partition_dataset(dataset: Any, num_clients: int, spec: Any, *, seed: int) -> IndexList:
    """:func:`partition_indices` over a training dataset (:func:`partition_labels`)."""
    method = getattr(spec, "method", "iid")
    return partition_indices(partition_labels(dataset, method), num_clients, spec, seed=seed)


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
    """Each client's test example indices (sorted int64), following ``parts`` (module docstring)."""
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
