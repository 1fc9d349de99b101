"""First of the workers' forkserver's preloads (:func:`paratrain.comm.forkserver.context`): the
cyclic collector off while the server imports torch and the workers' modules (a full pass
during ``import torch`` walks everything imported so far: ~15% of the import's CPU).
:mod:`.forkserver_frozen`, the last preload, turns it back on. CPython's advice for a process
that forks without exec (the ``gc.freeze`` documentation): ``gc.disable()`` early in the
parent, ``gc.freeze()`` right before ``fork()``."""

import gc

gc.disable()
