"""The last module the test session's forkserver preloads (tests/conftest.py) before paratrain's
own last one freezes the server's heap (paratrain.comm.forkserver_frozen): matplotlib with its
Agg backend (rank 0 of every launch draws report.png: about 0.45 s of CPU to import) and the
Shakespeare corpus the GPT jobs read (``data.test_every`` 8, the default: parsed once here, a
cache hit in every rank instead of 0.3 s of CPU each; py-spy of a full run counted ~70 s in
its parser)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401

from paratrain.data.shakespeare import load_corpus  # noqa: E402

load_corpus()
