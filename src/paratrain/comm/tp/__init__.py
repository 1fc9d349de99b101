"""Communication for tensor parallelism: :class:`~.comm.TPComm` (a group's collectives under
a pattern) on the groups of :mod:`.groups` (the ``dp x tp`` mesh, the 2-D grid). Why not
DTensor: its redistributions run the backend's own collectives, with no choice of how, while a
job picks one of five patterns here; every call is counted where it is made, for the run's
summary; per-rank lengths may differ (padded to the longest); and on gloo a reduce-scatter is
an all-reduce and a slice, twice the traffic (pytorch#118911), which those counts show rather
than hide. ``dtensor_parity`` in tests/_workers_tp.py checks the layers against
``torch.distributed.tensor.parallel``'s Colwise/RowwiseParallel.
"""
