"""Last of the workers' forkserver's preloads (:func:`paratrain.comm.forkserver.context`): one
full collection, then ``gc.freeze()`` of everything the server imported, then the collector
back on (:mod:`.forkserver_gc` turned it off). A worker is a fork of the server: the full pass
it makes as it starts (``training.gcfreeze.freeze_startup_objects``) then walks what the worker
built, not the few hundred thousand objects of torch and its compiler front end (0.04 s of CPU
instead of 0.3 s a rank), and touches none of the server's pages (no copy-on-write of its
heap in every rank)."""

import gc

gc.collect()
gc.freeze()
gc.enable()
