"""The last module the test session's forkserver preloads (tests/conftest.py): matplotlib with
its Agg backend (rank 0 of every launch draws report.png: about 0.45 s of CPU to import), the
Shakespeare corpus the GPT jobs read (``data.test_every`` 8, the default: parsed once here, a
cache hit in every rank instead of 0.3 s of CPU each; py-spy of a full run counted ~70 s in
its parser), then one full collection and ``gc.freeze()`` of everything the server holds.

Every worker is a fork of the server and inherits its frozen heap: the full pass a worker
makes as it starts (paratrain.training.gcfreeze.freeze_startup_objects) then walks what the
worker built, not the ~400,000 objects the server imported (torch, its compiler front end,
scikit-learn, transformers): 0.04 s of CPU instead of 0.3 s, and no copy-on-write of every
page of that heap, in every rank of every launch. CPython's advice for a process that forks
without exec (the ``gc.freeze`` documentation)."""

import gc

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401

from paratrain.data.shakespeare import load_corpus  # noqa: E402

load_corpus()

gc.collect()
gc.freeze()
