"""Federated on Flower's Deployment Runtime (``[federated] runtime = "flower"``): paratrain's
ServerApp (:mod:`.serverapp`, ``@app.main()`` drives paratrain's own round loop over the
``Grid``: :mod:`.serverloop`, :mod:`.federation`) and ClientApp (:mod:`.clientapp`:
``@app.train()`` / ``@app.evaluate()`` run the local path's client step on the node's own
partition, :mod:`.node`). Only :mod:`.serverapp`, :mod:`.clientapp` and :mod:`.federation`
import ``flwr`` (the ``flower`` extra); importing this package does not.
Start a federation and run the app: examples/federated_flower/README.md."""

from __future__ import annotations

__all__ = ["SERVER_APP", "CLIENT_APP"]

SERVER_APP = "paratrain.executors.federated.flower.serverapp:app"
CLIENT_APP = "paratrain.executors.federated.flower.clientapp:app"
