"""Federated on Flower's Deployment Runtime (``[federated] runtime = "flower"``): paratrain's
ServerApp (:mod:`.serverapp`, driving paratrain's own round loop, :mod:`.serverloop`) and
ClientApp (:mod:`.clientapp`, the local path's client step on the node's partition,
:mod:`.node`). Only :mod:`.serverapp`, :mod:`.clientapp`, :mod:`.federation` and
:mod:`.secure` import ``flwr`` (the ``flower`` extra). How to run: examples/federated_flower.
"""

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

