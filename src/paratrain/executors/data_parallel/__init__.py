"""DataParallel: replicas on disjoint shards, gradients combined every step (DESIGN §4).

- :mod:`.runner`: launch, the replica's set-up and its part of the one training loop;
- :mod:`.aggregation`: how gradients (or parameters) are combined: AllReduce,
  ParameterServer, Decentralized gossip, with or without compression.
"""

from .runner import run, shard_indices, train_replica, worker_main

__all__ = ["run", "worker_main", "train_replica", "shard_indices"]
