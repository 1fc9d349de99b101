"""Communication for tensor parallelism (the only place its collectives run).

- :mod:`.comm`: :class:`~.comm.TPComm`, one process group's collectives under a
  communication pattern (AllReduce, AllGather, ReduceScatter, PointToPoint, Hierarchical).
- :mod:`.groups`: :func:`~.groups.build_tp_groups`, the TP and DP sub-groups of a run.
- :mod:`.grid`: the row and column groups of a 2-D (``g x g``) TP grid.
- :mod:`.world`: world-level barrier, mean and broadcasts for the TP executor.

Counters and handles are in :mod:`paratrain.comm.stats`; the autograd operators that call
these collectives are in :mod:`paratrain.tensor_parallel.autograd`.
"""
