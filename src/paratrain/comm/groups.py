"""Process groups and gossip topologies.

Gossip (D-PSGD, Lian et al. 2017): ``ring``, ``torus`` (r x c, r the largest divisor of n with
r <= sqrt(n)) and ``complete``, mixed with Metropolis-Hastings weights ``W_ij = 1 / (1 +
max(d_i, d_j))``, ``W_ii = 1 - sum_j W_ij``: doubly stochastic, so ``x_i <- sum_j W_ij x_j``
keeps the average and contracts to consensus on a connected graph. Two-level groups follow
the real topology: ranks with equal :func:`host_label` (host name, plus the torchrun node:
``GROUP_RANK`` or ``rank // LOCAL_WORLD_SIZE``) form a local group; one host without
``LOCAL_WORLD_SIZE`` is **flat** (:func:`describe_hierarchy`: ``"flat (1 host)"``).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError
from .buckets import unflatten_into
from .collectives import CommCounter, count_op, nbytes_of
from .messages import batch_exchange

TOPOLOGIES = ("ring", "torus", "complete")


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of the torus for n ranks: rows = largest divisor <= sqrt(n)."""
    if n < 1:
        raise ValueError(f"need at least one rank (got {n})")
    r = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return r, n // r


def neighbors(topology: str, n: int) -> list[list[int]]:
    """Sorted neighbour ranks (self excluded) of every rank for ``topology``."""
    if topology not in TOPOLOGIES:
        raise ConfigError([("strategy.aggregation.topology",
                            f"unknown topology {topology!r}; valid: {', '.join(TOPOLOGIES)}")])
    out: list[set[int]] = [set() for _ in range(n)]
    if topology == "complete":
        for i in range(n):
            out[i] = set(range(n)) - {i}
    elif topology == "ring":
        for i in range(n):
            out[i] = {(i - 1) % n, (i + 1) % n} - {i}
    else:
        rows, cols = grid_shape(n)
        for i in range(n):
            r, c = divmod(i, cols)
            out[i] = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                      r * cols + (c - 1) % cols, r * cols + (c + 1) % cols} - {i}
    return [sorted(s) for s in out]


def mixing_weights(topology: str, n: int) -> torch.Tensor:
    """The n x n Metropolis-Hastings mixing matrix (float64, doubly stochastic)."""
    nb = neighbors(topology, n)
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in nb[i]:
            w[i, j] = 1.0 / (1 + max(len(nb[i]), len(nb[j])))
        w[i, i] = 1.0 - float(w[i].sum())
    return w


def gossip_average(tensors: Sequence[torch.Tensor], *, topology: str, group: Any = None,
                   counter: CommCounter | None = None) -> None:
    """One gossip round, in place: ``x_i <- sum_j W_ij x_j``; the tensors flattened into one
    buffer sent to every neighbour (``batch_isend_irecv``): ``deg * bytes`` per rank."""
    if not dist.is_initialized() or not tensors:
        return
    n = dist.get_world_size(group)
    if n == 1:
        return
    rank = dist.get_rank(group)
    nb = neighbors(topology, n)[rank]
    w = mixing_weights(topology, n)[rank]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    bufs = {j: torch.empty_like(flat) for j in nb}
    batch_exchange(dict.fromkeys(nb, flat), bufs, group=group)
    count_op(counter, "gossip_send", nbytes_of(flat) * len(nb))
    mixed = flat * float(w[rank])
    for j in nb:
        mixed.add_(bufs[j], alpha=float(w[j]))
    unflatten_into(mixed, [t.detach() for t in tensors])


def new_group(ranks: Sequence[int], *, backend: str | None = None) -> Any:
    """A process group over ``ranks`` (every rank of the world must call this)."""
    return dist.new_group(ranks=list(ranks), backend=backend)


_ALONE: dict[int, Any] = {}


def alone_group() -> Any:
    """A group of this process alone (its collectives are no-ops; None without
    torch.distributed), made once per process: a second local group of the same ranks would
    share the first one's store keys."""
    if not dist.is_initialized():
        return None
    rank = dist.get_rank()
    if rank not in _ALONE:
        _ALONE[rank] = dist.new_group(ranks=[rank], backend="gloo", use_local_synchronization=True)
    return _ALONE[rank]


def hierarchy_from_hosts(hosts: Sequence[str]) -> list[list[int]]:
    """The ranks with equal labels, ascending, groups by lowest rank:

    >>> hierarchy_from_hosts(["a", "a", "b", "b", "a"])
    [[0, 1, 4], [2, 3]]
    """
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(str(host), []).append(rank)
    return list(groups.values())


def host_label(rank: int, env: Mapping[str, str] | None = None, hostname: str | None = None) -> str:
    """This rank's topology label (see the module docstring)."""
    env = os.environ if env is None else env
    host = hostname if hostname is not None else socket.gethostname()
    local = env.get("LOCAL_WORLD_SIZE", "")
    if not local:
        return host
    try:
        size = int(local)
    except ValueError:
        size = 0
    if size < 1:
        raise ConfigError([("LOCAL_WORLD_SIZE", f"must be a positive integer (got {local!r})")])
    node = env.get("GROUP_RANK", "")
    return f"{host}/node{node if node else rank // size}"


def host_labels(group: Any = None) -> list[str]:
    """Every rank's :func:`host_label`, in rank order (collective over ``group``; the
    world when ``None``). Without an initialised process group: this process's label."""
    if not dist.is_initialized():
        return [host_label(0)]
    labels: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(labels, host_label(dist.get_rank()), group=group)
    return [str(x) for x in labels]


def describe_hierarchy(nodes: Sequence[Sequence[int]], labels: Sequence[str] | None = None) -> str:
    """A short account of a two-level layout for summaries, e.g. ``"flat (1 host)"`` or
    ``"2 local groups of 2 (2 hosts)"``."""
    hosts = len({lab.split("/node")[0] for lab in labels}) if labels else None
    on = f" ({hosts} host{'s' if hosts != 1 else ''})" if hosts is not None else ""
    if len(nodes) <= 1:
        return f"flat{on or ' (1 group)'}"
    sizes = sorted({len(n) for n in nodes})
    each = f"of {sizes[0]}" if len(sizes) == 1 else f"of sizes {', '.join(map(str, sizes))}"
    return f"{len(nodes)} local groups {each}{on}"
