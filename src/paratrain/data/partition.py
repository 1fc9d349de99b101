"""Federated partitioners: ``num_clients`` sorted int64 index arrays, disjoint and covering
every example once, a pure function of ``(labels, num_clients, parameters, seed)``:
``iid`` (a seeded permutation cut into near-equal parts), ``shards`` (McMahan et al. 2017:
label-sorted shards, ``shards_per_client`` random ones each), ``dirichlet`` (Hsu et al.
2019: each class split by ``p_k ~ Dir(α·1_N)``, then a ``min_size`` top-up from the largest
client) and ``speaker`` (LEAF Shakespeare: the speakers, seeded order, round-robin).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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
