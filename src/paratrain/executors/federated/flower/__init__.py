"""Federated on Flower's Deployment Runtime (``[federated] runtime = "flower"``): paratrain's
ServerApp (:mod:`.serverapp`, ``@app.main()`` drives paratrain's own round loop over the
``Grid``: :mod:`.serverloop`, :mod:`.federation`) and ClientApp (:mod:`.clientapp`:
``@app.train()`` / ``@app.evaluate()`` run the local path's client step on the node's own
partition, :mod:`.node`). Only :mod:`.serverapp`, :mod:`.clientapp` and :mod:`.federation`
import ``flwr`` (the ``flower`` extra); importing this package does not.
Start a federation and run the app: examples/federated_flower/README.md."""

from __future__ import annotations

from typing import Any


def describe_runtime(job: Any) -> str | None:
    """Which path a Federated job runs on (``paratrain validate`` / ``graph``); None otherwise."""
    strat: Any = job.strategy
    if getattr(strat, "type", None) != "Federated":
        return None
    if job.federated.runtime == "flower":
        return ("Flower's Deployment Runtime: `flwr run` paratrain's app (examples/federated_flower) "
                "against a SuperLink; SuperNode partition-id p of num-partitions P hosts the clients "
                "c % P == p")
    from .. import num_workers

    return f"the local path: `paratrain run`, {num_workers(job)} worker process(es) over torch.distributed"

